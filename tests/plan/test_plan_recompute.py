"""Full activation checkpointing in the dry-run and the time model's communication options
(docs/planning.md, "Recomputation" and "Calibration"): backward's recomputation counted for
the layer it recomputes, its collectives tagged as recomputation's, the TP/SP activation sums
in bf16, Float8's fp8 activation and weight gathers, async TP, a pipeline's FSDP traffic once per step."""
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
FLAT = plan.cluster("h100x8-gt").with_(intra_latency=0.0, inter_latency=0.0, launch_seconds=0.0)   # the device alone


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


def test_activation_sums_in_bf16_halve_their_bytes(full_ac):
    """``activation_sums="bfloat16"``: the TP/SP sums the step widens to float32 are sent in
    bf16 (half the bytes); the gathers and the FSDP reduce-scatters are unchanged."""
    fp32, bf16 = plan.cost(full_ac, FLAT), plan.cost(full_ac, FLAT, activation_sums="bfloat16")
    rs = "tp reduce_scatter (intra)"
    assert bf16.by_collective[rs] == pytest.approx(fp32.by_collective[rs] / 2, rel=1e-9)
    for k in ("tp all_gather (intra)", "dp_shard reduce_scatter (intra)", "dp_shard all_gather (intra)"):
        assert bf16.by_collective[k] == fp32.by_collective[k]
    assert any(e.widened for e in full_ac.runs[0].events if e.kind == "reduce_scatter" and e.axes == ("tp",))
    with pytest.raises(ValueError, match="activation_sums='int8'"):
        plan.cost(full_ac, FLAT, activation_sums="int8")


def test_float8_sends_the_forward_and_recomputed_activation_gathers_in_fp8(full_ac):
    """``float8``: the layers' sequence-parallel gathers in forward and in recomputation carry
    fp8 (half of bf16's bytes); backward's gradient gathers stay bf16."""
    bf16, fp8 = plan.cost(full_ac, FLAT), plan.cost(full_ac, FLAT, float8=True)
    events = lambda r: [e for e in r.events if e.kind == "all_gather" and e.axes == ("tp",)]   # noqa: E731
    halved = full_ac.extrapolate(lambda r: sum(e.bytes_sent for e in events(r)
                                               if e.layer is not None and (e.phase == "forward" or e.recompute)))
    assert 0 < halved < full_ac.extrapolate(lambda r: sum(e.bytes_sent for e in events(r)))
    ag = "tp all_gather (intra)"
    assert bf16.by_collective[ag] - fp8.by_collective[ag] == pytest.approx(halved / 2 / FLAT.intra_bandwidth, rel=1e-9)


def test_float8_all_gather_sends_the_layers_weight_gathers_in_fp8(full_ac):
    """``float8_all_gather`` (torchao's Float8 FSDP all-gather): the layers' FSDP gathers of
    their matrix weights carry fp8, in forward, backward and recomputation; the norms' 1-D
    weights, the embedding and the head (outside the layers), the gradients' reduce-scatters and
    the activation gathers stay as ``float8`` alone sends them. It needs ``float8``."""
    fp8 = plan.cost(full_ac, FLAT, float8=True)
    both = plan.cost(full_ac, FLAT, float8=True, float8_all_gather=True)
    gathers = lambda r: [e for e in r.events if e.kind == "all_gather" and e.weight_traffic]   # noqa: E731
    halved = full_ac.extrapolate(lambda r: sum(e.bytes_sent for e in gathers(r)
                                               if e.layer is not None and len(e.shape) >= 2))
    kept = full_ac.extrapolate(lambda r: sum(e.bytes_sent for e in gathers(r)
                                             if e.layer is None or len(e.shape) < 2))
    assert halved > 0 and kept > 0 and {e.phase for r in full_ac.runs for e in gathers(r)} >= {"forward", "backward"}
    ag = "dp_shard all_gather (intra)"
    assert fp8.by_collective[ag] - both.by_collective[ag] == pytest.approx(halved / 2 / FLAT.intra_bandwidth,
                                                                           rel=1e-9)
    for k in fp8.by_collective:
        if k != ag:
            assert both.by_collective[k] == fp8.by_collective[k], k
    with pytest.raises(ValueError, match="float8_all_gather=True .* needs float8=True"):
        plan.cost(full_ac, FLAT, float8_all_gather=True)


def test_async_tp_hides_its_fraction_of_the_tp_collectives(full_ac):
    """``async_tp``: ``async_tp_overlap`` of the TP activation all-gathers and reduce-scatters
    hides under compute; with no overlap nothing changes."""
    cl = FLAT.with_(async_tp_overlap=0.5)
    sync, fused = plan.cost(full_ac, cl), plan.cost(full_ac, cl, async_tp=True)
    tp = sync.by_collective["tp all_gather (intra)"] + sync.by_collective["tp reduce_scatter (intra)"]
    assert sync.exposed_comm_s - fused.exposed_comm_s == pytest.approx(0.5 * tp, rel=1e-9)
    assert fused.step_s == pytest.approx(sync.step_s - 0.5 * tp, rel=1e-9)
    assert plan.cost(full_ac, cl.with_(async_tp_overlap=0.0), async_tp=True).step_s == sync.step_s


def test_tp_comm_overlap_hides_all_but_one_chunk_per_tp_rank(full_ac):
    """``tp_comm_overlap`` (Megatron's: the collective in ``tp`` chunks pipelined under the
    chunked matmul) hides (tp - 1) / tp of the TP activation all-gathers and reduce-scatters
    within their phase's compute, from the mesh alone; it and ``async_tp`` are refused together."""
    sync, chunked = plan.cost(full_ac, FLAT), plan.cost(full_ac, FLAT, tp_comm_overlap=True)
    tp = sync.by_collective["tp all_gather (intra)"] + sync.by_collective["tp reduce_scatter (intra)"]
    assert sync.step_s - chunked.step_s == pytest.approx(tp * (MESH.shape["tp"] - 1) / MESH.shape["tp"], rel=1e-9)
    with pytest.raises(ValueError, match="async_tp .* and tp_comm_overlap"):
        plan.cost(full_ac, FLAT, async_tp=True, tp_comm_overlap=True)


def test_distributed_optimizer_reduce_scatters_gathers_and_updates_a_shard():
    """``distributed_optimizer`` (Megatron's, ZeRO-1) on a data-parallel mesh: each fp32
    gradient all-reduce over ``dp_replicate`` becomes a reduce-scatter of half its bytes in
    backward and an all-gather of a quarter (the bf16 parameters) in forward, and the update
    reads and writes 1/dp of the state; a norm's gradient all-reduced over ``dp_replicate`` x
    ``tp`` is summed over ``tp`` (critical path) and reduce-scattered over ``dp_replicate``."""
    rules = llama.default_rules(fsdp=False, sequence_parallel=True)
    mesh = fpp.Mesh(dp_replicate=2, tp=2)
    est = plan.estimate(LOSS, llama.init(CFG), mesh, rules, BATCH, precision="bf16")
    ddp, zero = plan.cost(est, FLAT), plan.cost(est, FLAT, distributed_optimizer=True)

    def grads(axes):
        return est.extrapolate(lambda r: sum(e.bytes_sent for e in r.events if e.weight_traffic
                                             and e.kind == "all_reduce" and e.axes == axes)) / FLAT.intra_bandwidth
    ar, norms = grads(("dp_replicate",)), grads(("dp_replicate", "tp"))
    assert ar > 0 and norms > 0
    loss_sums = ddp.by_collective["dp_replicate all_reduce (intra)"] - ar      # the loss's, unchanged
    assert zero.by_collective["dp_replicate all_reduce (intra)"] == pytest.approx(loss_sums, rel=1e-6, abs=1e-15)
    # the norms' buffer over dp_replicate x tp (4 ranks: 2 x 3/4 of it) is 4/6 of their bytes
    buffer = norms * 4 / 6
    assert zero.by_collective["dp_replicate reduce_scatter (intra)"] == pytest.approx(ar / 2 + buffer / 2, rel=1e-6)
    assert zero.by_collective["dp_replicate all_gather (intra)"] == pytest.approx((ar / 2 + buffer / 2) / 2, rel=1e-6)
    assert zero.by_collective["tp all_reduce (intra)"] - ddp.by_collective.get("tp all_reduce (intra)", 0.0) == \
        pytest.approx(buffer, rel=1e-6)
    assert "dp_replicate+tp all_reduce (intra)" not in zero.by_collective
    assert zero.update_s == pytest.approx(ddp.update_s / 2, rel=1e-9)


def test_a_pipelines_fsdp_traffic_is_reported_once_per_step():
    """``pp_fsdp_gather="step"``: the stage's FSDP units are gathered (in fp32 masters) and
    reduce-scattered once per step, so ``by_collective`` charges their bytes once, the bytes of
    the estimate's comm report; with "micro" once per micro-batch."""
    cfg = llama.Config.tiny(layers=8)
    loss, rules = functools.partial(llama.loss, cfg=cfg), fpp.Rules(batch="dp_shard", hidden="dp_shard", layers="pp")
    batch = {"tokens": ((16, 16), "batch seq"), "labels": ((16, 16), "batch seq")}
    mesh = fpp.Mesh(pp=2, dp_shard=4)
    for policy in ("step", "micro"):
        est = plan.estimate(loss, llama.init(cfg), mesh, rules, batch, grad_accum=4, pp_fsdp_gather=policy)
        t = plan.cost(est, FLAT)
        for kind in ("all_gather", "reduce_scatter"):
            sent = est.comm.bytes(kind, "dp_shard")
            assert t.by_collective[f"dp_shard {kind} (intra)"] == pytest.approx(sent / FLAT.intra_bandwidth, rel=1e-9)
