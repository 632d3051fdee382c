"""The caching allocator's model (plan/allocator.py) against the rules of PyTorch's
CUDACachingAllocator.cpp (and FSDP2's streams, torch/distributed/fsdp/_fully_shard), and
``validate --memory`` and ``plan`` printing the same reserved bytes for the same layout."""
import functools
import math

import pytest
import yaml

import functional_pp as fpp
from functional_pp import cli, plan
from functional_pp.app.report import human_bytes
from functional_pp.cli.plan import config_space, layout_yaml, rank_layouts
from functional_pp.config import TrainConfig
from functional_pp.core.tree import tree_leaves
from functional_pp.models import llama
from functional_pp.plan import fsdp2
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


def test_expandable_segments_grow_at_the_end_and_reuse_what_is_freed():
    """``expandable_segments:True``: a pool is one segment mapped in 20 MiB pages (large
    requests); a request no free block fits extends the free block at the end by the pages it
    lacks. The fragmentation above (44 MiB reserved for 20 live) does not arise: 40 MiB, and
    a 30 MiB request then adds one page, not a 30 MiB segment."""
    a = CachingAllocator(expandable_segments=True)
    a.malloc("a", 12 * MiB)                   # one page: 8 MiB free at the end
    a.malloc("b", 12 * MiB)                   # the free 8 MiB and one more page; 16 MiB free at the end
    assert a.reserved == 40 * MiB
    a.free("a")
    a.free("b")
    a.malloc("c", 20 * MiB)
    assert a.reserved == 40 * MiB
    a.malloc("d", 30 * MiB)                   # 20 MiB free at the end, one more page
    assert a.reserved == 60 * MiB
    a.malloc("s", 100)                        # the small pool grows in 2 MiB pages
    assert a.reserved == 62 * MiB and a.reserved_by_stream == {"compute": 62 * MiB}
    default = CachingAllocator()
    for k, n in (("a", 12), ("b", 12)):
        default.malloc(k, n * MiB)
    default.free("a")
    default.free("b")
    default.malloc("c", 20 * MiB)
    default.malloc("d", 30 * MiB)
    assert default.reserved == 74 * MiB


def test_each_stream_has_pools_of_its_own():
    """A block freed on FSDP's all-gather stream is cached for that stream: the compute stream
    takes a new segment for the same size, the all-gather stream reuses it."""
    a = CachingAllocator()
    a.malloc("gathered", 12 * MiB, "all_gather")
    a.free("gathered")
    a.malloc("x", 12 * MiB)
    assert a.reserved == 24 * MiB
    assert a.reserved_by_stream == {"all_gather": 12 * MiB, "compute": 12 * MiB}
    a.malloc("next", 12 * MiB, "all_gather")
    assert a.reserved == 24 * MiB
    a.free("x")
    a.malloc("s", 100, "reduce_scatter")        # small pools are per stream too
    a.malloc("t", 100)
    assert a.reserved_by_stream == {"all_gather": 12 * MiB, "compute": 14 * MiB, "reduce_scatter": 2 * MiB}


def test_fsdp2_units_from_the_dry_runs_gathers():
    """A layer's gathers in one phase are one unit; the weights outside the layers (the
    embedding first, the head after the layers) are one root unit at the start of each forward
    and are not gathered again in backward (FSDP2 does not reshard its root after forward)."""
    f, b = "forward", "backward"
    gathers = [((None, f, False), 4), ((0, f, False), 2), ((0, f, False), 3), ((1, f, False), 5),
               ((None, f, False), 6), ((None, b, False), 6), ((1, b, False), 5), ((0, b, False), 5),
               ((0, f, False), 5), ((None, f, False), 4), ((0, b, True), 5)]
    assert fsdp2.units(gathers) == [(10, True), (5, True), (5, True), (5, False), (5, False),
                                    (4, True), (5, True), (5, False)]


def test_fsdp2_buffers_are_on_their_streams_and_a_forward_gather_is_held_until_the_next():
    """With ``fsdp2_streams`` each layer's gathered weights are one FSDP unit whose flat all-gather
    buffer fills the all-gather stream's pool, and the reduce-scatter outputs the reduce-scatter
    stream's. Fully checkpointed, backward gathers one unit at a time, so the all-gather pool
    holds two units' bytes only because forward keeps a unit's buffer until the next unit's is
    allocated (FSDP2's ``AllGatherState``)."""
    cfg = llama.Config.tiny(layers=3, hidden=1024, heads=8, kv_heads=4, mlp=4096, vocab=512)
    decls = llama.init(cfg)
    batch = {k: ((4, 64), "batch seq") for k in ("tokens", "labels")}
    run = functools.partial(plan.estimate, functools.partial(llama.loss, cfg=cfg), decls, fpp.Mesh(dp_shard=2),
                            plan.standard_rules(("dp_shard",)), batch, precision="bf16", remat=True)
    est = run(fsdp2_streams=True)
    unit = 2 * sum(math.prod(d.shape) for d in tree_leaves(decls["layers"][0]))     # one layer, bf16
    streams = est.runs[-1].reserved_by_stream
    assert set(streams) == {"compute", "all_gather", "reduce_scatter"}
    assert 2 * unit <= streams["all_gather"] < 3 * unit
    assert est.runs[-1].peak_reserved == sum(streams.values())      # (segments are never returned)
    own = run()                   # this framework's step: its collectives' buffers on the compute stream
    assert set(own.runs[-1].reserved_by_stream) == {"compute"} and own.peak_bytes == est.peak_bytes
    assert own.reserved_bytes < est.reserved_bytes


def test_fsdp2_holds_a_steps_sharded_gradients_in_its_reduce_scatter_pool():
    """FSDP2's sharded gradients are views of each unit's reduce-scatter output, allocated on its
    reduce-scatter stream and held until the next step's ``zero_grad``: one buffer per layer (the
    last first) and the root's last, all held, so the pool reserves their segments (a 6 MiB unit
    shares a 20 MiB segment, a 100 MiB one has its own). With micro-steps each later output is
    added into them and freed. The dry-run's pool is replaced by the whole step's gradients."""
    assert fsdp2.held_gradients([6 * MiB] * 3) == 20 * MiB
    assert fsdp2.held_gradients([6 * MiB] * 4) == 40 * MiB
    assert fsdp2.held_gradients([100 * MiB, 6 * MiB]) == 120 * MiB
    assert fsdp2.held_gradients([6 * MiB] * 3, micro_steps=2) == 40 * MiB     # a 6 MiB output beside them
    cfg = llama.Config.tiny(layers=3, hidden=1024, heads=8, kv_heads=4, mlp=4096, vocab=512)
    decls = llama.init(cfg)
    batch = {k: ((4, 64), "batch seq") for k in ("tokens", "labels")}
    est = plan.estimate(functools.partial(llama.loss, cfg=cfg), decls, fpp.Mesh(dp_shard=2),
                        plan.standard_rules(("dp_shard",)), batch, precision="bf16", fsdp2_streams=True)
    run = est.runs[-1]
    units = fsdp2.sharded_gradients(decls, "layers", fpp.Mesh(dp_shard=2), plan.standard_rules(("dp_shard",)))
    layer = 4 * sum(math.prod(d.shape) for d in tree_leaves(decls["layers"][0])) // 2
    assert units[:3] == [layer] * 3 and sum(units) == 4 * sum(math.prod(d.shape) for d in tree_leaves(decls)) // 2
    assert sum(units) - layer == sum(n for _, n in run.gradient_shards)   # what its run of 2 layers reduce-scattered
    assert est.reserved_overhead == (run.peak_reserved - run.reserved_by_stream["reduce_scatter"]
                                     + fsdp2.held_gradients(units) - run.peak_bytes)
    assert fsdp2.held_gradients(units) > 4 * run.reserved_by_stream["reduce_scatter"]


def test_fsdp2_holds_its_root_and_the_last_layer_gathered_and_no_16_bit_shard_copies():
    """FSDP2 does not reshard its root unit after forward, and torchtitan not its last layer: at
    the loss's peak both are held gathered in 16 bits (the embedding and head, the last layer),
    whatever the number of layers run; FSDP2 casts a shard inside the gather's copy-in and frees
    it, where this framework's step keeps a 16-bit copy of every shard (one more per layer)."""
    cfg = llama.Config.tiny(layers=3, hidden=256, heads=4, kv_heads=2, mlp=512, vocab=32768)
    decls = llama.init(cfg)
    mesh, rules = fpp.Mesh(dp_shard=2), plan.standard_rules(("dp_shard",))
    batch = {k: ((4, 512), "batch seq") for k in ("tokens", "labels")}
    run = functools.partial(plan.estimate, functools.partial(llama.loss, cfg=cfg), decls, mesh, rules, batch,
                            precision="bf16")
    root = 2 * sum(math.prod(d.shape) for k, v in decls.items() if k != "layers" for d in tree_leaves(v))
    last = 2 * sum(math.prod(d.shape) for d in tree_leaves(decls["layers"][-1]))
    assert fsdp2.held_unsharded(decls, "layers", mesh, rules) == (root, last)
    est, own = run(fsdp2_streams=True), run()
    assert all("backward" in r.peak_at for r in est.runs + own.runs)      # at the loss
    assert [r.peak_breakdown["weights in flight"] for r in est.runs] == [root + last] * 2
    copies = [r.peak_breakdown["weights in flight"] for r in own.runs]
    assert copies[0] < copies[1] < root and est.peak_bytes - own.peak_bytes == root + last - own.memory[
        "weights in flight"]


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
