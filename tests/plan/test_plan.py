"""Layout planning: the dry-run (one device, meta tensors, layers extrapolated) counts exactly
what a real step sends and holds."""
import functools

import pytest
import torch

import functional_pp as fpp
from functional_pp import plan
from functional_pp.core.layout import local_shape
from functional_pp.models import llama
from functional_pp.plan.measure import measure

CFG = llama.Config.tiny()
LOSS = functools.partial(llama.loss, cfg=CFG)
BATCH = {"tokens": ((8, 16), "batch seq"), "labels": ((8, 16), "batch seq")}

# three layers: the dry-run runs 1 and 2 of them and extrapolates the third
CFG3 = llama.Config.tiny(layers=3, hidden=128, mlp=256)
LOSS3 = functools.partial(llama.loss, cfg=CFG3)
BATCH3 = {"tokens": ((8, 64), "batch seq"), "labels": ((8, 64), "batch seq")}
LAYOUTS = {
    "dp": (fpp.Mesh(dp_replicate=4), fpp.Rules(batch="dp_replicate")),
    "fsdp": (fpp.Mesh(dp_shard=4), fpp.Rules(batch="dp_shard", hidden="dp_shard")),
    "tp+sp": (fpp.Mesh(tp=2), llama.default_rules(sequence_parallel=True)),
    "cp": (fpp.Mesh(cp=4), fpp.Rules(seq="cp")),
    "hsdp+cp+tp+sp": (fpp.Mesh(dp_replicate=2, dp_shard=2, cp=2, tp=2), llama.default_rules(sequence_parallel=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_estimate_equals_a_measured_cpu_step(name):
    """Communication byte for byte, peak memory and saved activations within 10% (they are
    equal in practice) of a real step on CPU tensors, for DP, FSDP, TP+SP, CP and composed."""
    mesh, rules = LAYOUTS[name]
    est = plan.estimate(LOSS3, llama.init(CFG3), mesh, rules, BATCH3, precision="bf16")
    run, rep, _ = measure(LOSS3, llama.init(CFG3), mesh, rules, BATCH3, precision="bf16", rank=est.rank)
    assert est.layers == 3 and len(est.runs) == 2
    assert est.comm.by_axis() == rep.by_axis()
    assert est.flops == pytest.approx(sum(run.flops.values()), rel=1e-9)     # the same device's work
    assert abs(est.peak_bytes / run.peak_bytes - 1) < 0.10, (est.memory, run.peak_breakdown)
    assert abs(est.activation_bytes / run.saved_bytes - 1) < 0.10


def test_state_bytes_and_fp32_reductions_of_bf16():
    mesh, rules = fpp.Mesh(dp_shard=2, cp=2, tp=2), llama.default_rules(sequence_parallel=True)
    decls = llama.init(CFG, torch.bfloat16)
    est = plan.estimate(LOSS, decls, mesh, rules, BATCH, precision="bf16")
    n_local = sum(torch.Size(local_shape(d.shape, rules.resolve(d.dims, d.shape, mesh), mesh)).numel()
                  for _, d in fpp.leaves_with_paths(decls))
    assert est.param_bytes == 4 * n_local                 # fp32 master shards
    assert 0 <= est.state_bytes - 16 * n_local <= 16      # + fp32 gradients + two Adam moments (+ step count)
    grads = [e for e in est.comm.events if e.backward and e.kind == "reduce_scatter" and e.axes == ("dp_shard", "cp")]
    assert grads and all(e.dtype == "float32" for e in grads)   # the step sums bf16 gradients in fp32


def test_fsdp_memory_and_activation_scaling():
    decls = llama.init(CFG, torch.float32)
    one = plan.estimate(LOSS, decls, fpp.Mesh(), fpp.Rules(), BATCH)
    fsdp = plan.estimate(LOSS, decls, fpp.Mesh(dp_shard=4), fpp.Rules(batch="dp_shard", hidden="dp_shard"), BATCH)
    n = fpp.count_params(decls)
    assert 0 <= one.state_bytes - 16 * n <= 16                        # ZeRO: 16 bytes per fp32 parameter
    assert 0 <= fsdp.state_bytes - 16 * n // 4 <= 16                  # FSDP over 4 divides it by 4
    assert fsdp.activation_bytes < one.activation_bytes / 2           # a quarter of the batch per device
    assert one.comm_bytes == 0
    assert one.memory["weights"] == 4 * fpp.count_params(decls)
    assert sum(one.memory.values()) == one.peak_bytes


def test_layers_extrapolate_exactly():
    """estimate(1) + (L-1)(estimate(2) - estimate(1)) equals running all L layers."""
    cfg4 = llama.Config.tiny(layers=4)
    loss4 = functools.partial(llama.loss, cfg=cfg4)
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True)
    fast = plan.estimate(loss4, llama.init(cfg4), mesh, rules, BATCH)
    full = plan.estimate(loss4, llama.init(cfg4), mesh, rules, BATCH, repeated=None)
    assert len(fast.runs) == 2 and len(full.runs) == 1
    assert fast.comm.by_axis() == full.comm.by_axis()
    assert (fast.peak_bytes, fast.activation_bytes, fast.flops) == (full.peak_bytes, full.activation_bytes, full.flops)


def test_remat_under_fsdp_keeps_only_the_layer_inputs():
    """A checkpointed layer keeps only its inputs, with or without FSDP (FSDP's re-gather hooks
    used to replace the checkpoint's and keep every einsum input): measured on a real step."""
    fsdp = fpp.Rules(batch="dp_shard", hidden="dp_shard")
    dp = fpp.Rules(batch="dp_shard")
    mesh = fpp.Mesh(dp_shard=2)
    saved = {}
    for name, rules in (("fsdp", fsdp), ("dp", dp)):
        for remat in (False, True):
            run = measure(LOSS3, llama.init(CFG3), mesh, rules, BATCH3, remat=remat)[0]
            saved[f"{name} remat={remat}"] = run.saved_bytes
    assert saved["fsdp remat=True"] == saved["dp remat=True"]
    assert saved["fsdp remat=True"] < saved["fsdp remat=False"] / 4
    est = plan.estimate(LOSS3, llama.init(CFG3), mesh, fsdp, BATCH3, remat=True)
    # (real runs also keep the token-id range check's small tensors, which meta runs skip)
    assert est.activation_bytes == pytest.approx(saved["fsdp remat=True"], rel=0.01)


def test_the_tracker_counts_storages_from_creation_to_free():
    """The measuring instrument itself: live bytes, peak and its categories on known tensors."""
    from functional_pp.plan.tracker import MemoryTracker
    w = torch.zeros(10)                                   # 40 bytes held before: "weights"
    with MemoryTracker({"weights": 40}, [w]) as tr:
        a = torch.ones(100)                               # 400
        b = a * 2                                         # 400 -> 840 live
        v = b.view(10, 10)                                # a view: no new storage
        del a                                             # -> 440
        c = w + 1                                         # derived from the weights only: 40, "weights in flight"
        d = torch.ones(50, dtype=torch.float64)           # 400 -> 880 live: the peak
        peak_parts = dict(tr.run.peak_breakdown)
        del b, v, c, d
        e = torch.ones(10)                                # 40 -> 80 live
    assert tr.run.peak_bytes == 880
    assert peak_parts == {"weights": 40, "forward temporaries": 800, "weights in flight": 40}
    assert tr._current == 80 and e.numel() == 10


def test_uneven_work_is_estimated_on_the_busiest_device():
    """Causal ring attention over a contiguous cp split: device i of c computes i + 1/2 of the
    c^2/2 unmasked blocks, so rank 0 would flatter the layout; the dry-run estimates the
    announced busiest device (cp=3) and says so. Load-balanced: every device does 2 blocks."""
    decls, mesh = llama.init(CFG), fpp.Mesh(cp=4)
    contiguous = plan.estimate(LOSS, decls, mesh, fpp.Rules(seq="cp"), BATCH)
    rank0 = plan.estimate(LOSS, decls, mesh, fpp.Rules(seq="cp"), BATCH, rank=0)
    even = plan.estimate(LOSS, decls, mesh, fpp.Rules(seq=fpp.balanced("cp")), BATCH)
    assert contiguous.rank == 3 and rank0.rank == 0 and even.rank == 0
    assert any("uneven work: causal ring attention" in n for n in contiguous.notes) and not even.notes
    # attention FLOPs beyond rank 0's half block: 3 blocks on device 3, 1.5 when balanced
    assert contiguous.flops - rank0.flops == pytest.approx(2 * (even.flops - rank0.flops), rel=1e-12)
    assert even.flops > rank0.flops
    assert contiguous.comm.by_axis() == rank0.comm.by_axis()
    busiest = measure(LOSS, decls, mesh, fpp.Rules(seq="cp"), BATCH, rank=3)[0]     # a real step, device 3
    assert sum(busiest.flops.values()) == pytest.approx(contiguous.flops, rel=1e-9)
