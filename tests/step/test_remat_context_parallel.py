"""Activation checkpointing under context parallelism (docs/memory.md, "Selective recomputation";
docs/layouts.md, "Recurrences under context parallelism"): full and selective remat of layers whose
sequence is split over ``cp`` train as one device without checkpointing, for plain attention (FSDP
over cp, so each layer's gather is prefetched by the layer before: the recomputation issues it
itself) and for a hybrid whose recurrent layers run the chain of blocks."""
import pytest
import torch
from harness import assert_processes_equal_one_device, assert_same_run, launch_steps

import functional_pp as fpp
from functional_pp.models import llama

LLAMA = llama.Config.tiny(layers=2)
QWEN3_5 = llama.Config(model_type="qwen3_5_text", vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8,
                       mlp=64, rope_theta=10000.0, rope_scaling=None, q_gate=True, qk_norm=True, norm_offset=1.0,
                       partial_rotary_factor=0.25, linear_heads=4, linear_kv_heads=2, linear_head_dim=8,
                       linear_v_head_dim=6, layer_types=("linear_attention", "full_attention"))
CP = fpp.Mesh(cp=2), llama.default_rules(tp=False)           # (FSDP over cp: hidden over dp_shard x cp)
CP_TP = fpp.Mesh(cp=2, tp=2), llama.default_rules(sequence_parallel=True)


def assert_equals_one_device(cfg, mesh, rules, compile=False, **step_kw):
    one = launch_steps(cfg, dtype=torch.float64)[0]
    for run in launch_steps(cfg, compile=compile, mesh=mesh, rules=rules, dtype=torch.float64, **step_kw):
        assert_same_run(run, one, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("remat", ["selective", True])
@pytest.mark.parametrize("layout", [CP, CP_TP], ids=["cp", "cp_tp_sp"])
def test_remat_of_attention_under_cp_equals_one_device(layout, remat):
    assert_equals_one_device(LLAMA, *layout, remat=remat)


def test_compiled_selective_remat_under_cp_equals_one_device():
    assert_equals_one_device(LLAMA, *CP, compile="aot_eager", remat="selective")


@pytest.mark.parametrize("remat", ["selective", "selective_alternate", True])
def test_remat_of_a_recurrent_hybrid_under_cp_equals_one_device(remat):
    assert_equals_one_device(QWEN3_5, *CP, remat=remat)


def test_selective_remat_under_cp_on_real_processes_equals_one_device():
    assert_processes_equal_one_device(QWEN3_5, *CP, remat="selective")


GDR = dict(batch="batch", seq="seq", heads="heads", kv_heads="kvh", head_dim="hd", v_head_dim="vd", chunk=4)
INPUTS = dict(q=((2, 64, 2, 16), "batch seq kvh hd"), k=((2, 64, 2, 16), "batch seq kvh hd"),
              v=((2, 64, 2, 16), "batch seq heads vd"), g=((2, 64, 2), "batch seq heads"),
              beta=((2, 64, 2), "batch seq heads"))


@fpp.layer
def delta_mixer(q, k, v, g, beta):
    from functional_pp.ops.linear_attention import gated_delta_rule
    return gated_delta_rule(fpp.ops.silu(q), fpp.ops.silu(k), fpp.ops.silu(v), g, beta, **GDR)


def chain_under_remat():
    """Per remat mode, one forward and backward of a layer that is a gated delta rule (the chain of
    blocks under cp): the loss, q/k/v's gradients and the bytes the forward left allocated."""
    from memtrack import window_peaks
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(shape, generator=gen, dtype=torch.float64) for n, (shape, _) in INPUTS.items()}
    full["g"], full["beta"] = -torch.nn.functional.softplus(full["g"]), full["beta"].sigmoid()
    rules = fpp.Rules(seq=fpp.balanced("cp"))
    out = {}
    for mode in (False, "selective", True):
        with fpp.use_rules(rules):
            named = {n: fpp.named(full[n], dims) for n, (_, dims) in INPUTS.items()}
        leaves = {n: x.data.clone().requires_grad_(n in "qkv") for n, x in named.items()}
        args = [named[n].replace(data=leaves[n]) for n in INPUTS]
        with fpp.use_rules(rules), fpp.configure(remat=mode), window_peaks() as w:
            with w.window():
                o = delta_mixer(*args)
                loss = fpp.ops.mean(o * o, ("batch", "seq", "heads", "vd")).value()
            loss.backward()
        out[mode] = (loss.detach(), [leaves[n].grad for n in "qkv"], w.retained[0])
    return out


def test_remat_recomputes_the_chains_blocks_and_keeps_their_values():
    """Under remat the chain's blocks are checkpointed like the rest of a layer (each recomputed on its
    device in the chain's backward): on cp 2 (gloo processes) the forward leaves less allocated with
    selective remat and a small fraction with full remat, and the loss and gradients do not change
    (the loss is one device's)."""
    one = fpp.launch(chain_under_remat, fpp.Mesh())[0]
    for run in fpp.launch(chain_under_remat, fpp.Mesh(cp=2), processes=True):
        loss, grads, kept = run[False]
        torch.testing.assert_close(loss, one[False][0], rtol=1e-12, atol=0)
        for mode in ("selective", True):
            assert torch.equal(run[mode][0], loss), mode
            for a, b in zip(run[mode][1], grads):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
        # measured: 403 KB kept without remat, 138 KB selective, 15 KB full (the blocks' graphs kept
        # whatever the remat before: 408 KB and 293 KB)
        assert run[True][2] < kept / 10 and run[True][2] < run["selective"][2] < kept / 2, \
            {m: run[m][2] for m in run}
