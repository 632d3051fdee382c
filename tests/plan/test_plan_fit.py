"""The planner never chooses a layout over the memory limit when one within it exists in its
space, searches the memory levers (checkpointing, micro-batch size, pipelines), keeps what the
config fixes, and prints a choice that, pasted into the config, ``validate --memory`` reproduces
to the byte. Oracles: the exhaustive search of the same space, and ``validate``."""
from __future__ import annotations

import functools

import pytest
import yaml

from functional_pp import cli, plan
from functional_pp.app.report import _human_bytes, planned_estimate
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
    assert set(config_space(free).remat) == {False, True, "selective"} and config_space(free).micro_batch_sizes == "all"
    assert config_space(fixed).remat == (True,) and config_space(fixed).micro_batch_sizes == (2,)
    space = dict(max_axis={"tp": 1, "cp": 1}, fsdp=(("dp_shard",),), keep_gathered=(False,))
    ranked = {name: rank_layouts(c, 2, "h100x8", space=plan.Space(**{**vars(config_space(c)), **space}))
              for name, c in (("free", free), ("fixed", fixed))}
    assert all(e.settings["remat"] is True for e in ranked["fixed"])
    assert {e.settings["grad_accum"] for e in ranked["fixed"]} == {2}          # 4 sequences per rank / 2
    assert {e.settings["remat"] for e in ranked["free"]} == {False, True, "selective"}
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
    assert peak.startswith(f"peak:       {_human_bytes(best.peak_bytes)} per device")


@pytest.mark.parametrize("mesh, rules, remat", [
    (dict(dp_shard=2), plan.standard_rules(("dp_shard",)), True),
    (dict(tp=2), plan.standard_rules((), sequence_parallel=True), False)])
def test_many_micro_steps_are_extrapolated_from_two_and_three_exactly(mesh, rules, remat):
    import collections

    import functional_pp as fpp
    cfg = llama.Config.tiny(layers=3)
    batch = {k: ((12, 16), "batch seq") for k in ("tokens", "labels")}
    kw = dict(precision="bf16", grad_accum=6, remat=remat, timeline=False)
    args = (functools.partial(llama.loss, cfg=cfg), llama.init(cfg), fpp.Mesh(**mesh), rules, batch)
    fast, full = plan.estimate(*args, **kw), plan.estimate(*args, **kw, extrapolate_micro_steps=False)
    assert fast.micro_steps and len(fast.runs) == 4 and full.micro_steps is None
    assert collections.Counter(fast.comm.events) == collections.Counter(full.comm.events)
    for what in ("peak_bytes", "activation_bytes", "state_bytes", "memory"):
        assert getattr(fast, what) == getattr(full, what), what
    assert fast.flops == pytest.approx(full.flops, rel=1e-12)
    assert plan.cost(fast, "h100x8").step_s == pytest.approx(plan.cost(full, "h100x8").step_s, rel=1e-9)
