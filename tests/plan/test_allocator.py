"""The caching allocator's model (plan/allocator.py) against the rules of PyTorch's
CUDACachingAllocator.cpp, and ``validate --memory`` and ``plan`` printing the same reserved
bytes for the same layout."""
import pytest
import yaml

from functional_pp import cli, plan
from functional_pp.app.report import human_bytes
from functional_pp.cli.plan import config_space, layout_yaml, rank_layouts
from functional_pp.config import TrainConfig
from functional_pp.plan.allocator import CachingAllocator, rounded, segment_size

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert [rounded(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB              # small pool
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB


def test_blocks_are_split_reused_and_merged():
    a = CachingAllocator()
    a.malloc("x", 4 * MiB)                    # a 20 MiB segment, split: 16 MiB cached
    a.malloc("y", 12 * MiB)                   # fits the cached rest: no new segment
    assert a.reserved == 20 * MiB
    a.free("x")
    a.free("y")                               # merged back into one 20 MiB block
    a.malloc("z", 20 * MiB)
    assert a.reserved == 20 * MiB
    a.malloc("s", 100)                        # the small pool has its own 2 MiB segments
    assert a.reserved == 22 * MiB


def test_fragmentation_a_freed_block_too_small_or_in_another_segment_is_not_reused():
    """Two 12 MiB blocks freed in two segments do not make room for 20 MiB: reserved grows
    to 44 MiB where 20 would be live (what max_memory_reserved shows and max_memory_allocated
    does not)."""
    a = CachingAllocator()
    for k in ("a", "b"):
        a.malloc(k, 12 * MiB)
    a.free("a")
    a.free("b")
    a.malloc("c", 20 * MiB)
    assert a.reserved == a.peak_reserved == 44 * MiB
    with_rest = CachingAllocator()
    with_rest.malloc("d", 11 * MiB + 1)       # a 12 MiB segment handed out whole: its rest is under 1 MiB
    with_rest.malloc("e", 2 * MiB)            # so the next request takes a new 20 MiB segment
    assert with_rest.reserved == 12 * MiB + 20 * MiB


@pytest.mark.parametrize("compile", [False, "per_layer"])
def test_validate_memory_and_plan_give_the_same_reserved_bytes(tmp_path, capsys, compile):
    """(``compile: per_layer``: both estimate the compiled layers' saved tensors, plan.estimate(compiled=True).)"""
    raw = {"model": "tiny", "sequence_len": 32, "global_batch_size": 8, "micro_batch_size": 2, "optimizer": "sgd",
           "momentum": 0.9, "lr_scheduler": "constant", "max_grad_norm": None, "data": {"max_bytes": 100_000},
           "compile": compile}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = TrainConfig.from_yaml(str(path))
    space = plan.Space(**{**vars(config_space(cfg)), "remat": (False,), "micro_batch_sizes": (2,)})
    best = rank_layouts(cfg, 2, "h100x8", space=space).fitting()[0]
    assert best.reserved_bytes > best.peak_bytes
    assert best.settings["compiled_layers"] == bool(compile)
    pasted = tmp_path / "pasted.yaml"
    pasted.write_text(yaml.safe_dump({**raw, **yaml.safe_load(layout_yaml(cfg, best, 2))}))
    assert cli.main(["validate", str(pasted), "--simulate", "2", "--memory"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("reserved:"))
    assert line.startswith(f"reserved:   {human_bytes(best.reserved_bytes)} per device")
    assert cli.main(["plan", str(pasted), "--devices", "2", "--cluster", "h100x8"]) == 0
    out = capsys.readouterr().out
    chosen = out.split("chose ")[1]
    if chosen.startswith(best.describe() + ":"):
        assert f"(reserved {human_bytes(best.reserved_bytes)})" in chosen
    else:
        pytest.fail(f"plan chose {chosen.splitlines()[0]}, not {best.describe()}")
