"""The decoder families' switches under ``torch.compile`` (aot_eager): sliding windows
(alternating per layer: the layer's window is an argument of the compiled layer), q/k/v biases,
Gemma 2's soft-capped attention and logits, sandwich norms and tanh-GELU GLU, the switches of
SmolLM3, Granite, OLMo 2, Cohere, Phi and GPT-NeoX; whole-step and
per-layer compiled training equal eager."""

import pytest
import torch
from harness import assert_same_run, launch_steps

import functional_pp as fpp
from functional_pp.models import llama

CONFIGS = {
    "qwen2": llama.Config.tiny(model_type="qwen2", qkv_bias=True, tie_embeddings=True, sliding_window=5,
                               layer_types=("full_attention", "sliding_attention")),
    "gemma2": llama.Config.tiny(model_type="gemma2", mlp_act="gelu_tanh", norm_offset=1.0, scale_embeddings=True,
                                sandwich_norms=True, query_pre_attn_scalar=24.0, attn_softcap=2.0, final_softcap=3.0,
                                sliding_window=5, layer_types=("sliding_attention", "full_attention"),
                                tie_embeddings=True),
    # the new families' switches together: GPT-NeoX's parallel block of LayerNorms with biases,
    # GELU MLP with biases and partial rotary, a NoPE layer (the layer's pos is None), OLMo 2's
    # q/k norms over every head, Cohere's interleaved rotary, Granite's multipliers, Phi's LM-head bias
    "new_switches": llama.Config.tiny(parallel_block=True, parallel_mlp_norm=True, norm_kind="layer", norm_bias=True,
                                      mlp_gated=False, mlp_bias=True, mlp_act="gelu", partial_rotary_factor=0.5,
                                      nope_layers=(1,), qk_norm=True, qk_norm_heads=True, rotary_interleaved=True,
                                      embedding_multiplier=2.0, residual_multiplier=0.5, logit_scale=0.5,
                                      lm_head_bias=True),
    # GPT-2's learned positions (the table's rows of the traced positions), DBRX's q/k/v clamp,
    # Nemotron's LayerNorm1P (1 + w, a bias) with squared ReLU
    "learned_positions": llama.Config.tiny(learned_positions=True, clip_qkv=0.1, norm_kind="layer", norm_bias=True,
                                           norm_offset=1.0, mlp_gated=False, mlp_act="relu2", max_seq=32),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("mode", ["aot_eager", pytest.param("per_layer:aot_eager", marks=pytest.mark.slow)])
def test_compiled_training_equals_eager(family, mode):
    cfg = CONFIGS[family]
    opt = fpp.optim.adamw(1e-2)
    # both with the loss as a traced step computes it (a per-layer compile runs the loss eagerly)
    compiled = launch_steps(cfg, mode, batch=2, opt=opt, loss_as_traced=True)[0]
    eager = launch_steps(cfg, False, batch=2, opt=opt, loss_as_traced=True)[0]
    assert_same_run(compiled, eager, rtol=1e-5, atol=1e-7)
