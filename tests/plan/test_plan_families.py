"""The planner's dry-run of the decoder families' configurations (sliding windows in some
layers, q/k/v biases, q/k norms, Gemma 2's soft-capped attention with its explicit scores,
OLMo 2's norms, GPT-NeoX's parallel block, GPT-2's learned positions, DeepSeek's latent attention):
communication byte for byte and memory within 10% of a real CPU step, layers extrapolated."""
import functools

import pytest

import functional_pp as fpp
from functional_pp import plan
from functional_pp.models import llama
from functional_pp.plan.measure import measure

BATCH = {"tokens": ((8, 64), "batch seq"), "labels": ((8, 64), "batch seq")}
SIZE = dict(layers=3, hidden=128, mlp=256)
CONFIGS = {
    "qwen2": llama.Config.tiny(model_type="qwen2", qkv_bias=True, sliding_window=16, **SIZE),
    "qwen3": llama.Config.tiny(model_type="qwen3", qk_norm=True, head_dim=32, **SIZE),
    "gemma2": llama.Config.tiny(model_type="gemma2", mlp_act="gelu_tanh", norm_offset=1.0, scale_embeddings=True,
                                sandwich_norms=True, query_pre_attn_scalar=32.0, attn_softcap=50.0,
                                final_softcap=30.0, sliding_window=16, tie_embeddings=True, **SIZE),
    # OLMo 2's q/k norms over every head (a sum across tp); GPT-NeoX's parallel block of LayerNorms
    # with biases, GELU MLP with biases, partial rotary
    "olmo2": llama.Config.tiny(model_type="olmo2", pre_norms=False, sandwich_norms=True, qk_norm=True,
                               qk_norm_heads=True, **SIZE),
    "gpt_neox": llama.Config.tiny(model_type="gpt_neox", parallel_block=True, parallel_mlp_norm=True, norm_kind="layer",
                                  norm_bias=True, mlp_gated=False, mlp_bias=True, mlp_act="gelu", qkv_bias=True,
                                  o_bias=True, partial_rotary_factor=0.25, kv_heads=4, **SIZE),
    # GPT-2's table of learned positions (each device's rows of it under CP)
    "gpt2": llama.Config.tiny(model_type="gpt2", learned_positions=True, norm_kind="layer", norm_bias=True,
                              mlp_gated=False, mlp_bias=True, mlp_act="gelu_tanh", qkv_bias=True, o_bias=True,
                              kv_heads=4, tie_embeddings=True, max_seq=64, **SIZE),
    # DeepSeek's multi-head latent attention (q latent, v heads wider than the q/k heads)
    "deepseek_v3": llama.Config.tiny(model_type="deepseek_v3", kv_heads=4, kv_lora_rank=32, q_lora_rank=48,
                                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32, rotary_interleaved=True,
                                     **SIZE),
}
LAYOUTS = {
    "fsdp": (fpp.Mesh(dp_shard=4), fpp.Rules(batch="dp_shard", hidden="dp_shard")),
    "tp+sp": (fpp.Mesh(tp=2), llama.default_rules(sequence_parallel=True)),
    "cp": (fpp.Mesh(cp=2), fpp.Rules(seq="cp")),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(CONFIGS))
def test_estimate_equals_a_measured_cpu_step(family, layout):
    cfg, (mesh, rules) = CONFIGS[family], LAYOUTS[layout]
    loss, decls = functools.partial(llama.loss, cfg=cfg), llama.init(cfg)
    est = plan.estimate(loss, decls, mesh, rules, BATCH, precision="bf16")
    run, rep, _ = measure(loss, decls, mesh, rules, BATCH, precision="bf16", rank=est.rank)
    assert est.layers == 3
    assert est.comm.by_axis() == rep.by_axis()
    assert abs(est.peak_bytes / run.peak_bytes - 1) < 0.10, (est.memory, run.peak_breakdown)
    assert abs(est.activation_bytes / run.saved_bytes - 1) < 0.10
