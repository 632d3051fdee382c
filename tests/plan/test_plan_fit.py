"""The planner never chooses a layout over the memory limit when one within it exists in its
space, searches the memory levers (checkpointing, micro-batch size, pipelines), keeps what the
config fixes, and prints a choice that, pasted into the config, ``validate --memory`` reproduces
to the byte. Oracles: the exhaustive search of the same space, and ``validate``."""
from __future__ import annotations

import functools

import pytest
import yaml

from functional_pp import cli, plan
from functional_pp.app.report import human_bytes, planned_estimate
from functional_pp.cli.plan import config_space, layout_yaml, rank_layouts
from functional_pp.config import TrainConfig, model_config
from functional_pp.models import llama

CFG = llama.Config.tiny(layers=8)
BATCH = {"tokens": ((8, 256), "batch seq"), "labels": ((8, 256), "batch seq")}
# 2 devices without tp or cp: data parallel, FSDP or a 2-stage pipeline, each with or without remat
# and with micro-batches of 1 or 4 sequences
PIPELINE_SPACE = plan.Space(pp=(1, 2), schedules=("1f1b",), remat=(False, True), sequence_parallel=(False,),
                            regather_activations=(False,), keep_gathered=(False,), micro_batch_sizes=(1, 4),
                            max_axis={"cp": 1, "tp": 1}, precision="fp32")


def _every_estimate(space: plan.Space) -> list:
    """(candidate, estimate) of every candidate of ``space``, as ``search`` evaluates them."""
    pairs = []

    def record(cands, evaluate):
        pairs.extend((c, evaluate(c)) for c in cands)
        return [e for _, e in pairs if e is not None]
    plan.search(functools.partial(llama.loss, cfg=CFG), llama.init(CFG), 2, BATCH, cluster="h100x8", space=space,
                strategy=record)
    return [(c, e) for c, e in pairs if e is not None]


@pytest.mark.slow
def test_beam_keeps_the_only_layouts_that_fit_checkpointed_pipelines():
    pairs = _every_estimate(PIPELINE_SPACE)
    piped = [e for _, e in pairs if e.mesh.shape.get("pp", 1) > 1 and e.settings["remat"]]
    # the limit: just below every layout that is not a checkpointed pipeline
    limit = min(e.peak_bytes for _, e in pairs if e not in piped) - 1
    assert any(e.peak_bytes <= limit for e in piped), "the space should have a checkpointed pipeline that fits"
    by_candidate = {id(c): e for c, e in pairs}

    def evaluate(c):
        e = by_candidate.get(id(c))
        if e is not None:
            e.settings["fits"] = e.peak_bytes <= limit
        return e
    cands = [c for c, _ in pairs]
    for width in (1, 2):
        chosen = plan.beam(width)(cands, evaluate)
        fitting = [e for e in chosen if e.peak_bytes <= limit]
        assert fitting and all(e in piped for e in fitting)
        assert len(chosen) < len(cands)                # the beam did prune
    exhaustive_best = min((e for _, e in pairs if e.peak_bytes <= limit), key=lambda e: e.time.step_s)
    assert exhaustive_best in plan.beam(1)(cands, evaluate)


def _write(tmp_path, name: str, **keys) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"model": "tiny", "sequence_len": 32, "global_batch_size": 8,
                                    "optimizer": "sgd", "momentum": 0.9, "lr_scheduler": "constant",
                                    "max_grad_norm": None, "data": {"max_bytes": 100_000}, **keys}))
    return str(path)


def test_config_fixes_checkpointing_and_micro_batch_and_the_plan_honours_them(tmp_path):
    free = TrainConfig.from_yaml(_write(tmp_path, "free.yaml"))
    fixed = TrainConfig.from_yaml(_write(tmp_path, "fixed.yaml", gradient_checkpointing=True, micro_batch_size=2))
    assert set(config_space(free).remat) == {False, True, "selective", "selective_alternate"} and config_space(free).micro_batch_sizes == "all"
    assert config_space(fixed).remat == (True,) and config_space(fixed).micro_batch_sizes == (2,)
    space = dict(max_axis={"tp": 1, "cp": 1}, fsdp=(("dp_shard",),), keep_gathered=(False,))
    ranked = {name: rank_layouts(c, 2, "h100x8", space=plan.Space(**{**vars(config_space(c)), **space}))
              for name, c in (("free", free), ("fixed", fixed))}
    assert all(e.settings["remat"] is True for e in ranked["fixed"])
    assert {e.settings["grad_accum"] for e in ranked["fixed"]} == {2}          # 4 sequences per rank / 2
    assert {e.settings["remat"] for e in ranked["free"]} == {False, True, "selective", "selective_alternate"}
    assert {e.settings["grad_accum"] for e in ranked["free"]} == {1, 2, 4}
    free = {e.describe(): e for e in ranked["free"]}
    for e in ranked["fixed"]:       # the fixed estimates are the free ones with remat, which saves activations
        assert free[e.describe()].peak_bytes == e.peak_bytes
        assert free[e.describe().replace(" remat", "")].activation_bytes > e.activation_bytes


def test_the_pasted_keys_reproduce_the_layout_and_validate_gives_the_same_peak(tmp_path, capsys):
    n = 2
    path = _write(tmp_path, "c.yaml")
    cfg = TrainConfig.from_yaml(path)
    space = plan.Space(**{**vars(config_space(cfg)), "remat": (False, "selective"), "micro_batch_sizes": (2,)})
    ranking = rank_layouts(cfg, n, "h100x8", space=space)
    picks = {}                                          # one of each kind of layout the space has
    for e in ranking:
        s = e.mesh.shape
        kind = (s.get("dp_replicate", 1) > 1, s.get("dp_shard", 1) > 1, s.get("cp", 1) > 1, s.get("tp", 1) > 1,
                "tp" in e.rules["res_seq"], e.settings["remat"], len(e.rules.table.get("hidden") or ()))
        picks.setdefault(kind, e)
    assert len(picks) >= 6
    for e in picks.values():
        pasted = yaml.safe_load(layout_yaml(cfg, e, n))
        raw = {**yaml.safe_load(open(path)), **pasted}
        again = _write(tmp_path, "pasted.yaml", **raw)
        cfg2 = TrainConfig.from_yaml(again)
        cfg2.validate(n)
        mesh = cfg2.mesh(n)
        rules = cfg2.build_rules(mesh)
        assert dict(mesh.shape) == {a: v for a, v in e.mesh.shape.items()}, e.describe()
        other = planned_estimate(cfg2, mesh, rules, model_config(cfg2))
        assert (other.peak_bytes, other.comm_bytes, other.activation_bytes) == \
            (e.peak_bytes, e.comm_bytes, e.activation_bytes), e.describe()
    best = ranking.fitting()[0]
    again = _write(tmp_path, "best.yaml", **{**yaml.safe_load(open(path)), **yaml.safe_load(layout_yaml(cfg, best, n))})
    assert cli.main(["validate", again, "--simulate", str(n), "--memory"]) == 0
    peak = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("peak:"))
    assert peak.startswith(f"peak:       {human_bytes(best.peak_bytes)} per device")


@pytest.mark.parametrize("mesh, rules, remat", [
    (dict(dp_shard=2), plan.standard_rules(("dp_shard",)), True),
    (dict(tp=2), plan.standard_rules((), sequence_parallel=True), False)])
def test_many_micro_steps_are_extrapolated_from_two_and_three_exactly(mesh, rules, remat):
    import collections

    import functional_pp as fpp
    cfg = llama.Config.tiny(layers=3)
    batch = {k: ((16, 16), "batch seq") for k in ("tokens", "labels")}
    kw = dict(precision="bf16", grad_accum=8, remat=remat, timeline=False)
    args = (functools.partial(llama.loss, cfg=cfg), llama.init(cfg), fpp.Mesh(**mesh), rules, batch)
    fast, full = plan.estimate(*args, **kw), plan.estimate(*args, **kw, extrapolate_micro_steps=False)
    assert fast.micro_steps and len(fast.runs) == 4 and full.micro_steps is None
    assert collections.Counter(fast.comm.events) == collections.Counter(full.comm.events)
    for what in ("peak_bytes", "activation_bytes", "state_bytes", "memory"):
        assert getattr(fast, what) == getattr(full, what), what
    assert fast.flops == pytest.approx(full.flops, rel=1e-12)
    assert plan.cost(fast, "h100x8").step_s == pytest.approx(plan.cost(full, "h100x8").step_s, rel=1e-9)


@pytest.mark.slow
def test_llama3_8b_at_8k_on_64_gpus_chooses_a_layout_that_fits(tmp_path):
    """The issue's case: examples/configs/4d.yaml with model 8b, 8192 tokens, 64 sequences per step,
    micro-batches of 1, on 64 H100s (tp and cp up to 2 to keep the test short)."""
    raw = yaml.safe_load(open("examples/configs/4d.yaml"))
    raw.update(model="8b", sequence_len=8192, global_batch_size=64, micro_batch_size=1)
    (tmp_path / "8b.yaml").write_text(yaml.safe_dump(raw))
    cfg = TrainConfig.from_yaml(str(tmp_path / "8b.yaml"))
    space = plan.Space(**{**vars(config_space(cfg)), "max_axis": {"cp": 2, "tp": 2}})
    ranking = rank_layouts(cfg, 64, "h100x8", strategy="beam", space=space)
    limit = plan.cluster("h100x8").memory_bytes
    chosen = ranking[0]
    assert chosen.reserved_bytes <= limit and ranking.fitting()[0] is chosen
    assert any(e.reserved_bytes > limit for e in ranking)          # the space has layouts that do not fit
    for e in ranking:               # micro_batch_size: 1 kept: accumulation makes up the 64 sequences
        assert e.settings["grad_accum"] * e.mesh.shape["dp_replicate"] * e.mesh.shape["dp_shard"] == 64
    text = cli.plan.explain(ranking, cfg)
    assert text.startswith(f"chose {chosen.describe()}:") and "NO LAYOUT FITS" not in text


def test_plan_prints_full_names_in_gib_the_keys_to_paste_and_says_when_nothing_fits(tmp_path, capsys):
    path = _write(tmp_path, "c.yaml", micro_batch_size=2, gradient_checkpointing=False, reshard_after_forward=True)
    assert cli.main(["plan", path, "--devices", "2", "--cluster", "a100x8", "--top", "50"]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in out and "estimated" in err and " GB" not in out
    assert "peak GiB" in out and "tok/s/dev" in out and "MFU" in out
    table = out.split("chose ")[0]
    unwrapped = " ".join(line.strip() for line in table.splitlines())
    cfg = TrainConfig.from_yaml(path)
    ranking = rank_layouts(cfg, 2, "a100x8")
    for e in ranking:                                           # every name in full
        assert e.describe() in unwrapped
    keys = yaml.safe_load(out.split("to train it, set in the config:\n")[1].split("Pareto front")[0])
    assert keys["micro_batch_size"] == 2 and keys["activation_checkpointing"] is False
    assert {"dp_shard_size", "tp_size", "global_batch_size", "gradient_accumulation_steps"} <= set(keys)
    smallest = min(e.reserved_bytes for e in ranking)
    assert cli.main(["plan", path, "--devices", "2", "--memory-gib", str(smallest / 2 ** 30 * 0.99)]) == 1
    out = capsys.readouterr().out
    assert "NO LAYOUT FITS" in out and "chose" not in out
    assert "activation_checkpointing: true (the config fixes activation_checkpointing" in out
    assert "micro_batch_size: 1" in out and "more devices" in out
    near = min(ranking, key=lambda e: e.reserved_bytes)
    assert f"The nearest is {near.describe()} at {human_bytes(near.reserved_bytes)} reserved" in out
    assert cli.main(["plan", "--cluster", "help"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}: " in out for name in plan.PRESETS) and "Grand Teton" in out and "GiB" in out
