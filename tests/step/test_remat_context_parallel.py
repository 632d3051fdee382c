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


@pytest.mark.parametrize("remat", ["selective", True])
def test_remat_of_a_recurrent_hybrid_under_cp_equals_one_device(remat):
    assert_equals_one_device(QWEN3_5, *CP, remat=remat)


def test_selective_remat_under_cp_on_real_processes_equals_one_device():
    assert_processes_equal_one_device(QWEN3_5, *CP, remat="selective")
