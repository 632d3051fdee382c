"""The time model against published runs (docs/planning.md, "Calibration"): torchtitan's Llama
3.1 8B and 70B rows predicted within 15% by the fitted preset, MFU counted as torchtitan
counts it, the FLOP and traffic counts the model rests on, and the fit itself."""
import functools

import pytest
import torch

import functional_pp as fpp
from functional_pp import plan
from functional_pp.models import llama
from functional_pp.plan import references

TINY = llama.Config.tiny(layers=3)
BATCH = {"tokens": ((2, 32), "batch seq"), "labels": ((2, 32), "batch seq")}


@pytest.fixture(scope="module")
def tiny():
    return plan.estimate(functools.partial(llama.loss, cfg=TINY), llama.init(TINY), fpp.Mesh(), fpp.Rules(), BATCH)


def test_attention_and_selective_recompute_flops_are_counted_exactly(tiny):
    b, s, h, d, L = 2, 32, TINY.heads, TINY.hidden // TINY.heads, TINY.layers
    attn = lambda r: r.attention_flops["forward"]                  # noqa: E731
    dense = 4 * b * h * s * s * d * L                               # QK^T and AV, causal counted as full
    assert tiny.extrapolate(attn) == dense / 2                      # causal: half
    assert tiny.extrapolate(lambda r: r.attention_flops["backward"]) == 2.5 * dense / 2
    assert tiny.extrapolate(lambda r: r.dense_attention_forward) == dense
    # torchtitan's op-level selective AC recomputes every second matmul of a layer: k, o, up
    kv = TINY.kv_heads * d
    every_other = 2 * b * s * TINY.hidden * (kv + TINY.hidden + TINY.mlp) * L
    assert tiny.extrapolate(lambda r: r.every_other_mm_forward) == every_other
    assert 0 < tiny.extrapolate(lambda r: r.layer_forward_traffic) < tiny.extrapolate(lambda r: r.traffic["forward"])


@pytest.fixture(scope="module")
def rows():
    return [(r, *references.predict(r, "h100x8-gt")) for r in references.LLAMA3_8B]


def test_the_fitted_preset_predicts_every_published_row_within_15_percent(rows):
    for ref, tps, t in rows:
        assert tps == pytest.approx(ref.tokens_per_s_per_gpu, rel=0.15), ref.name
        # one layer's compute (matmuls, attention, traffic) x 32 layers: all but the ends and the recomputation
        assert 0.7 * t.compute_s < 32 * t.per_layer["compute"] < t.compute_s
    # the uncalibrated model (0.6 of peak for everything, no recomputation, no memory traffic,
    # full overlap) was 1.9x optimistic on the first row
    old = plan.cluster("h100x8-gt").with_(compute_efficiency=0.6, attention_efficiency=0.6, memory_efficiency=1e9,
                                          overlap=1.0)
    t = plan.cost(references.reference_estimate(rows[0][0]), old)
    assert 2 * 8192 / t.step_s > 1.8 * rows[0][0].tokens_per_s_per_gpu


def test_mfu_is_counted_as_torchtitan_counts_it(rows):
    """torchtitan: (6 x (parameters - embedding) + 12 x layers x heads x head_dim x seq) per
    token over peak; its 8B tables say 33% (eager) to 39% (compiled)."""
    cfg = llama.Config.llama3_8b()
    n = fpp.count_params(llama.init(cfg, torch.bfloat16)) - cfg.vocab * cfg.hidden
    per_token = 6 * n + 12 * cfg.layers * cfg.heads * (cfg.hidden // cfg.heads) * 8192
    for ref, tps, t in rows:    # counted from the matmuls: the norms' weights (0.003%) are left out
        assert t.mfu == pytest.approx(per_token * tps / 989e12, rel=1e-4)
    assert rows[0][2].mfu == pytest.approx(0.33, abs=0.02) and rows[1][2].mfu == pytest.approx(0.39, abs=0.02)


def test_fit_cluster_finds_the_matmul_efficiency_of_the_published_rows(rows):
    eager = [r for r in references.LLAMA3_8B if not r.compiled]
    start = plan.cluster("h100x8-gt").with_(compute_efficiency=0.3)
    fitted = plan.fit_cluster(start, [(references.reference_estimate(r), 2 * 8192 / r.tokens_per_s_per_gpu,
                                       r.cost_options()) for r in eager], fit=("compute_efficiency",), rounds=2)
    assert fitted.compute_efficiency == pytest.approx(plan.cluster("h100x8-gt").compute_efficiency, rel=0.05)
    with pytest.raises(ValueError, match=r"\['warp'\] are not numbers of a Cluster"):
        plan.fit_cluster(start, [], fit=("warp",))


def test_bus_bandwidth_grows_with_the_message_size_as_nccl_tests_curves_do():
    """Alpha-beta per ring step: large all-reduces reach the NVLink bandwidth (nccl-tests:
    460-480 GB/s on 8 H100 SXM5), small all-gathers pay g-1 latencies (half the bandwidth at
    g x latency x bandwidth bytes); a small all-reduce takes NCCL's tree, 2 ceil(log2 g)
    latencies, where the ring's 2(g-1) would cost it 40x more over 384 ranks."""
    cl = plan.cluster("h100x8-gt")
    sizes = [2 ** k for k in range(16, 33)]
    curve = [cl.bus_bandwidth("all_reduce", s, 8) for s in sizes]
    assert curve == sorted(curve) and curve[-1] == pytest.approx(cl.intra_bandwidth, rel=0.01)
    half = 8 * cl.intra_latency * cl.intra_bandwidth
    assert cl.bus_bandwidth("all_gather", half, 8) == pytest.approx(cl.intra_bandwidth / 2)
    link = ("inter", cl.inter_bandwidth, cl.inter_latency)
    assert cl.collective_parts("all_reduce", 4096, 384, link)[0] == pytest.approx(18 * cl.inter_latency)
    nvlink = ("intra", cl.intra_bandwidth, cl.intra_latency)     # a large one over 8: the ring's fewer bytes win
    assert cl.collective_parts("all_reduce", 4e9, 8, nvlink)[0] == pytest.approx(14 * cl.intra_latency)
    assert cl.bus_bandwidth("all_gather", 4e9, 128, "inter") == pytest.approx(cl.inter_bandwidth, rel=0.05)


def test_float8_runs_the_layers_linear_matmuls_at_the_fp8_peak(tiny):
    """``float8``: the layers' linear matmuls (q, k, v, o, gate, up, down: forward and the two
    backward products) at ``peak_fp8_flops x float8_efficiency``, their operands' casts as
    memory traffic; attention, the head and the other kernels as in bf16."""
    b, s, d, L = 2, 32, TINY.hidden // TINY.heads, TINY.layers
    kv = TINY.kv_heads * d
    linear = 2 * b * s * TINY.hidden * (2 * TINY.hidden + 2 * kv + 3 * TINY.mlp) * L
    assert tiny.extrapolate(lambda r: r.linear_flops["forward"]) == linear
    assert tiny.extrapolate(lambda r: r.linear_flops["backward"]) == 2 * linear
    cl = plan.cluster("h100x8-gt").with_(compiled_traffic=1.0)
    bf16, fp8 = plan.cost(tiny, cl), plan.cost(tiny, cl, float8=True)
    mm, f8 = cl.peak_flops * cl.compute_efficiency, cl.peak_fp8_flops * cl.float8_efficiency
    casts = 5 * tiny.extrapolate(lambda r: sum(r.linear_operands.values()))    # bf16 read twice, fp8 written
    want = bf16.compute_s - 3 * linear * (1 / mm - 1 / f8) + casts / (cl.memory_bandwidth * cl.memory_efficiency)
    assert fp8.compute_s == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="'a100x8' has no FP8 matmuls"):
        plan.cost(tiny, "a100x8", float8=True)


def test_the_float8_rows_are_predicted_within_15_percent(rows):
    """torchtitan's 8B compiled + Float8 rows (8 and 128 H100s), which ``float8_efficiency``
    is fitted to: within 15% of each, and Float8's speedup over the compiled bf16 rows (1.28x)
    within 15% too."""
    for ref, bf16 in zip(references.LLAMA3_8B_FLOAT8, [rows[1], rows[3]]):
        tps, _ = references.predict(ref, "h100x8-gt")
        assert tps == pytest.approx(ref.tokens_per_s_per_gpu, rel=0.15), ref.name
        assert tps / bf16[1] == pytest.approx(ref.tokens_per_s_per_gpu / bf16[0].tokens_per_s_per_gpu, rel=0.15)


def test_the_70b_rows_are_predicted_within_15_percent():
    """torchtitan's 70B rows (FSDP 32 x TP 8 on 256 H100s, compiled, Float8, full AC): 829
    tokens/s/GPU, 876 with async TP. ``async_tp_overlap`` is fitted to their ratio; the level
    is not fitted: each within 15%, and async TP's gain is its fraction of the TP collectives."""
    sync, fused = references.LLAMA3_70B
    (t1, s1), (t2, s2) = references.predict(sync, "h100x8-gt"), references.predict(fused, "h100x8-gt")
    assert t1 == pytest.approx(sync.tokens_per_s_per_gpu, rel=0.15)
    assert t2 == pytest.approx(fused.tokens_per_s_per_gpu, rel=0.15)
    assert t2 / t1 == pytest.approx(fused.tokens_per_s_per_gpu / sync.tokens_per_s_per_gpu, rel=0.01)
    tp = s1.by_collective["tp all_gather (intra)"] + s1.by_collective["tp reduce_scatter (intra)"]
    assert s1.step_s - s2.step_s == pytest.approx(plan.cluster("h100x8-gt").async_tp_overlap * tp, rel=1e-6)


def test_fused_recompute_drops_exactly_what_the_checkpointed_regions_recompute():
    """Under ``remat`` the dry-run counts the memory traffic of what backward recomputes
    (``DeviceRun.recompute_traffic``; none without it); ``cost(..., fused_recompute=True)``
    (XLA fusing it into the backward kernels that read it) charges all but that traffic."""
    fn, decls = functools.partial(llama.loss, cfg=TINY), llama.init(TINY)
    remat = plan.estimate(fn, decls, fpp.Mesh(), fpp.Rules(), BATCH, remat="selective")
    plain = plan.estimate(fn, decls, fpp.Mesh(), fpp.Rules(), BATCH)
    recomputed = remat.extrapolate(lambda r: r.recompute_traffic)
    assert plain.extrapolate(lambda r: r.recompute_traffic) == 0
    assert 0 < recomputed < remat.extrapolate(lambda r: r.traffic["backward"])
    cl = plan.cluster("h100x8")
    saved = plan.cost(remat, cl).compute_s - plan.cost(remat, cl, fused_recompute=True).compute_s
    assert saved == pytest.approx(recomputed / (cl.memory_bandwidth * cl.memory_efficiency), rel=1e-9)
    assert plan.cost(plain, cl, fused_recompute=True).step_s == plan.cost(plain, cl).step_s


def test_inter_overlap_hides_its_fraction_of_the_traffic_across_nodes_only():
    """``Cluster.inter_overlap``: the weight traffic that crosses nodes (here the data-parallel
    all-reduce over ``dp_replicate``, one rank per node) hides by its own fraction, the
    traffic inside a node (FSDP over ``dp_shard``) by ``overlap``; unset, both by ``overlap``."""
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2)
    est = plan.estimate(functools.partial(llama.loss, cfg=TINY), llama.init(TINY), mesh,
                        llama.default_rules(), {k: ((4, 32), "batch seq") for k in BATCH})
    slow = plan.cluster("h100x8").with_(devices_per_node=2, peak_flops=1e9)     # compute hides everything it may
    t = plan.cost(est, slow)
    comps = [plan.timing.run_components(r, mesh, slow) for r in est.runs]

    def total(key):
        return est.extrapolate_values([c.get(key, 0.0) for c in comps])
    inter = sum(total(f"weight inter {ph}") for ph in ("forward", "backward"))
    intra = sum(total(f"weight {ph}") for ph in ("forward", "backward")) - inter
    assert inter > 0 and intra > 0 and plan.cost(est, slow.with_(inter_overlap=slow.overlap)).step_s == t.step_s
    for f in (0.0, 0.5):
        exposed = plan.cost(est, slow.with_(inter_overlap=f)).exposed_comm_s - t.exposed_comm_s
        assert exposed == pytest.approx((slow.overlap - f) * inter, rel=1e-6)
    everything = plan.cost(est, slow.with_(overlap=1.0, inter_overlap=0.0))
    assert everything.hidden_comm_s == pytest.approx(intra, rel=1e-6)
