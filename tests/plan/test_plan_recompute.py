"""Full activation checkpointing in the dry-run (docs/planning.md, "Recomputation"):
backward's recomputation counted for the layer it recomputes, its collectives tagged as
recomputation's."""
import functools

import pytest

import functional_pp as fpp
from functional_pp import plan
from functional_pp.models import llama

CFG = llama.Config.tiny(layers=4)
LOSS = functools.partial(llama.loss, cfg=CFG)
BATCH = {"tokens": ((6, 32), "batch seq"), "labels": ((6, 32), "batch seq")}
MESH = fpp.Mesh(dp_shard=2, tp=2)
RULES = llama.default_rules(fsdp=True, sequence_parallel=True)
#: no latency: every collective's seconds are its bytes over the link's bandwidth
FLAT = plan.cluster("h100x8-gt").with_(intra_latency=0.0, inter_latency=0.0)


def _estimate(remat: bool, repeated="layers", **kw):
    return plan.estimate(LOSS, llama.init(CFG), MESH, RULES, BATCH, precision="bf16", remat=remat,
                         repeated=repeated, **kw)


@pytest.fixture(scope="module")
def full_ac():
    return _estimate(True)


def test_recomputation_counts_for_the_layer_it_recomputes(full_ac):
    """The 1- and 2-layer runs attribute each layer's recomputation and backward to that layer,
    so what the layers' linear matmuls do (Float8's part) extrapolates over the layers: the
    1-layer run's backward equals what the second layer adds. Before, backward under full AC
    kept the layer before it: none for the first, so the 1-layer run had no such backward and
    the second layer's increment carried two layers' worth."""
    one, two = full_ac.runs
    for counts in (lambda r: r.linear_flops["backward"], lambda r: r.linear_operands["backward"]):
        assert counts(one) == counts(two) - counts(one) > 0
    assert one.linear_by_layer[0] == two.linear_by_layer[0] == two.linear_by_layer[1]
    # per layer (this device's TP share): forward, its recomputation but the last matmul (down: its
    # output is not saved, so non-reentrant checkpointing stops before it), and backward's two products
    b, s, h, kv, f, tp = 3, 32, CFG.hidden, CFG.kv_heads * CFG.hidden // CFG.heads, CFG.mlp, 2
    forward = 2 * b * s * h * (2 * h + 2 * kv + 3 * f) // tp
    assert one.linear_flops["forward"] == forward
    assert one.linear_flops["backward"] == 3 * forward - 2 * b * s * f * h // tp


def test_collectives_of_the_recomputation_are_tagged(full_ac):
    """Under full AC backward re-gathers each layer's FSDP unit and repeats its TP/SP gathers;
    those events are tagged ``recompute`` and belong to the recomputed layer; without AC
    nothing is."""
    two = full_ac.runs[1]
    for layer in (0, 1):
        fwd = sorted((e.kind, e.axes, e.shape) for e in two.events
                     if e.phase == "forward" and e.layer == layer and e.kind == "all_gather")
        again = sorted((e.kind, e.axes, e.shape) for e in two.events
                       if e.recompute and e.layer == layer and e.kind == "all_gather")
        assert fwd and again == fwd              # the unit's gathers and the sequence-parallel gathers
    assert all(e.phase == "backward" for e in two.events if e.recompute)
    assert not any(e.recompute for r in _estimate(False).runs for e in r.events)


def test_recomputed_collectives_are_weight_traffic_by_their_inputs_as_in_forward():
    """Backward tells gradient traffic by shape; the recomputation is forward again, so its
    collectives are weight traffic iff they gather parameters, as in forward. With 2 sequences
    per device the sequence-parallel block (2, 16, 64) has the shape of the gathered k weight
    (2 kv heads x 16 x 64): by shape the recomputed activation gathers would pass for weights."""
    batch = {k: ((4, 32), "batch seq") for k in BATCH}
    est = plan.estimate(LOSS, llama.init(CFG), MESH, RULES, batch, precision="bf16", remat=True)
    again = [e for e in est.runs[1].events if e.recompute and e.kind == "all_gather"]
    assert {e.shape for e in again if e.axes == ("tp",)} == {(2, 16, 64)}
    assert all(e.weight_traffic == (e.axes == ("dp_shard",)) for e in again)
