"""FSDP units (functional_pp/parallel/fsdp/units.py): each layer's weights gathered with one flat
all-gather, re-gathered for backward with one, their gradients reduce-scattered with one;
the same numbers as the per-weight collectives and the single device, the same bytes, and
(n-1)/n · P_layer · B per unit and direction (docs/communication.md)."""
import pytest
import torch
from harness import assert_same_run, make_batch, train_steps

import functional_pp as fpp
from functional_pp.models import llama

CFG = llama.Config.tiny()
DATA = [make_batch(CFG, batch=8, seq=16, seed=i) for i in range(2)]
B = 8                                                     # fp64
D = CFG.dim_head
P_LAYER = (2 * CFG.hidden + CFG.hidden * D * (2 * CFG.heads + 2 * CFG.kv_heads) + 3 * CFG.hidden * CFG.mlp)
ONE = fpp.launch(train_steps(CFG, DATA, fpp.Mesh(), fpp.Rules()), fpp.Mesh())[0]


def _numel(e):
    n = 1
    for s in e.shape:
        n *= s
    return n


def _check(mesh, rules, step_kw=()):
    """Units against per-weight collectives (bitwise) and one device; with the root re-gathered
    (``fsdp_keep_root=False`` unless given) both send the same bytes."""
    step_kw = {"fsdp_keep_root": False, **dict(step_kw)}
    per_weight = fpp.launch(train_steps(CFG, DATA, mesh, rules, fsdp_units=False, **step_kw), mesh)
    units = fpp.launch(train_steps(CFG, DATA, mesh, rules, **step_kw), mesh)
    for a, b in zip(units, per_weight):
        assert_same_run(a, b)                                 # bitwise: same elements, same sums
        assert_same_run(a, ONE, rtol=1e-9, atol=1e-11)
        if not step_kw["fsdp_keep_root"]:
            assert sum(e.bytes_sent for e in a[2]) == sum(e.bytes_sent for e in b[2])
    return units[0][2], per_weight[0][2]


def _unit_events(events, axes):
    """Collectives over ``axes`` of one layer's flat weights: (kind, backward) -> [numel]."""
    out: dict = {}
    for e in events:
        if e.axes == axes and len(e.shape) == 1 and _numel(e) > CFG.hidden and e.kind in ("all_gather",
                                                                                          "reduce_scatter"):
            out.setdefault((e.kind, e.backward), []).append(_numel(e))
    return out


def test_fsdp_one_flat_collective_per_layer_and_direction():
    n = 2
    units, per_weight = _check(fpp.Mesh(dp_shard=n), llama.default_rules(tp=False))
    flat = _unit_events(units, ("dp_shard",))
    assert flat == {("all_gather", False): [P_LAYER // n] * CFG.layers,        # forward gather
                    ("all_gather", True): [P_LAYER // n] * CFG.layers,         # backward re-gather
                    ("reduce_scatter", True): [P_LAYER] * CFG.layers}          # gradients
    per_unit = (n - 1) * P_LAYER * B // n
    assert {e.bytes_sent for e in units if len(e.shape) == 1 and _numel(e) > CFG.hidden} == {per_unit}
    # backward: re-gathering the last layer prefetches the one before it, ahead of the
    # last layer's reduce-scatter (two layers)
    order = [e.kind for e in units if e.backward and len(e.shape) == 1 and _numel(e) > CFG.hidden]
    assert order == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
    weights_per_layer = 9
    count = lambda ev, kind: sum(1 for e in ev if e.kind == kind)  # noqa: E731
    assert count(per_weight, "reduce_scatter") - count(units, "reduce_scatter") == CFG.layers * (weights_per_layer - 1)
    assert count(per_weight, "all_gather") - count(units, "all_gather") == 2 * CFG.layers * (weights_per_layer - 1)


def test_fsdp_units_with_remat_and_hsdp():
    remat, _ = _check(fpp.Mesh(dp_shard=2), llama.default_rules(tp=False), dict(remat=True))
    # recomputing a layer gathers its unit again: still one flat all-gather per layer in backward
    assert len(_unit_events(remat, ("dp_shard",))[("all_gather", True)]) == CFG.layers
    hsdp, _ = _check(fpp.Mesh(dp_replicate=2, dp_shard=2), llama.default_rules(tp=False))
    # HSDP: the replicate all-reduce still runs on the reduce-scattered shards, bucketed
    replicate = [e for e in hsdp if e.axes == ("dp_replicate",) and e.shape != ()]
    P = fpp.count_params(llama.init(CFG))
    assert sum(e.bytes_sent for e in replicate) == 2 * (2 - 1) * (P // 2) * B // 2


def test_root_kept_gathered_is_not_regathered():
    """FSDP2-style root (the default): the LM head and final norm gathered in forward are kept
    for backward; only the layers are re-gathered, (n-1)/n · P_layer · B each."""
    n = 2
    units, per_weight = _check(fpp.Mesh(dp_shard=n), llama.default_rules(tp=False), dict(fsdp_keep_root=True))
    regathered = sum(e.bytes_sent for e in units if e.kind == "all_gather" and e.backward)
    assert regathered == CFG.layers * ((n - 1) * P_LAYER * B // n)
    saved = sum(e.bytes_sent for e in per_weight) - sum(e.bytes_sent for e in units)
    head_and_norm = CFG.hidden * CFG.vocab + CFG.hidden
    assert saved == (n - 1) * CFG.hidden * CFG.vocab * B // n + (n - 1) * CFG.hidden * B // n == \
        (n - 1) * head_and_norm * B // n


@pytest.mark.slow
def test_fsdp_units_composed_with_cp_tp_sequence_parallel():
    mesh = fpp.Mesh(dp_shard=2, cp=2, tp=2)
    units, _ = _check(mesh, llama.default_rules(sequence_parallel=True))
    assert len(_unit_events(units, ("dp_shard", "cp"))[("reduce_scatter", True)]) == CFG.layers


def _gloo_variants():
    mesh, rules = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)
    runs = {name: train_steps(CFG, DATA, mesh, rules, **kw)() for name, kw in
            [("per_weight", dict(fsdp_units=False)), ("units", dict())]}
    return {k: (losses, params, [(e.kind, e.shape, e.backward) for e in events]) for k, (losses, params, events)
            in runs.items()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp_units_on_gloo_processes():
    real = fpp.launch(_gloo_variants, fpp.Mesh(dp_shard=2), processes=True, timeout=300)
    for runs in real:
        assert_same_run(runs["units"], runs["per_weight"])
        assert_same_run(runs["units"], ONE, rtol=1e-9, atol=1e-11)
        flat = [e for e in runs["units"][2] if e[0] == "reduce_scatter" and e[1] == (P_LAYER,)]
        assert len(flat) == CFG.layers
        order = [e[0] for e in runs["units"][2] if e[2] and e[1] in ((P_LAYER,), (P_LAYER // 2,))]
        assert order == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]   # prefetch
