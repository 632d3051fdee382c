"""The decoder families' switches under ``torch.compile`` (aot_eager): sliding windows
(alternating per layer: the layer's window is an argument of the compiled layer), q/k/v biases,
Gemma 2's soft-capped attention and logits, sandwich norms and tanh-GELU GLU; whole-step and
per-layer compiled training equal eager."""
import functools

import pytest
import torch
from harness import local_batch, make_batch

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


def _train(cfg, compile, steps=2):
    mesh, rules = fpp.Mesh(), fpp.Rules()
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-2), mesh=mesh, rules=rules,
                          compile=compile)
    data = [make_batch(cfg, batch=2, seq=16, seed=i) for i in range(steps)]

    def device():
        state = step.init(fpp.init(llama.init, cfg, torch.float32, mesh=mesh, rules=rules, seed=0))
        losses = []
        for b in data:
            with fpp.use_rules(rules):
                local = {k: v.data for k, v in local_batch(b, mesh, rules).items()}
            state, m = step(state, local)
            losses.append(m["loss"])
        return losses, state["params"]
    return fpp.launch(device, mesh, timeout=1800)[0]


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("mode", ["aot_eager", pytest.param("per_layer:aot_eager", marks=pytest.mark.slow)])
def test_compiled_training_equals_eager(family, mode):
    cfg = CONFIGS[family]
    (losses, params), (losses0, params0) = _train(cfg, mode), _train(cfg, False)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses0), rtol=1e-6, atol=0)
    for (path, a), (_, b) in zip(fpp.leaves_with_paths(params), fpp.leaves_with_paths(params0)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{path}: {m}")
