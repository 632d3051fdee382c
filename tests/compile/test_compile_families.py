"""The decoder families' switches under ``torch.compile`` (aot_eager): sliding windows
(alternating per layer: the layer's window is an argument of the compiled layer), q/k/v biases,
Gemma 2's soft-capped attention and logits, sandwich norms and tanh-GELU GLU; whole-step and
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
    compiled, eager = launch_steps(cfg, mode, batch=2, opt=opt)[0], launch_steps(cfg, False, batch=2, opt=opt)[0]
    assert_same_run(compiled, eager, rtol=1e-5, atol=1e-7)
