"""ops.experts on one device: the routed experts equal transformers' own MoE blocks (Qwen3-MoE
with and without renormalised top-k weights, Mixtral), the load-balancing loss equals
transformers' ``load_balancing_loss_func`` over several layers, DeepSeek-style sigmoid routing
with a selection bias equals a plain-torch reference, and bad input is refused by name."""
import pytest
import torch
import torch.nn.functional as F

import functional_pp as fpp
from functional_pp.ops.experts import experts, load_balancing_loss

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

H, F_, E = 16, 8, 4


def _ours(blk, x, top_k, normalize, scale=1.0):
    """Our op with the weights of a transformers block (fused gate_up_proj [E, 2F, H])."""
    gu = blk.experts.gate_up_proj.detach()
    gate, up = gu[:, :F_].transpose(1, 2).contiguous(), gu[:, F_:].transpose(1, 2).contiguous()
    down = blk.experts.down_proj.detach().transpose(1, 2).contiguous()
    router = blk.gate.weight.detach().T.contiguous() * scale
    return experts(fpp.wrap(x, "batch seq hidden"), fpp.wrap(router, "hidden experts"),
                   fpp.wrap(gate, "experts hidden mlp"), fpp.wrap(up, "experts hidden mlp"),
                   fpp.wrap(down, "experts mlp hidden"), top_k=top_k, normalize=normalize)


def _block(cls, conf, seed=0):
    torch.manual_seed(seed)
    blk = cls(conf)
    blk.experts.config._experts_implementation = "eager"
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return blk


@pytest.mark.parametrize("normalize", [False, True])
def test_equals_qwen3_moe_block(normalize):
    conf = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F_, num_experts=E, num_experts_per_tok=2,
                                       norm_topk_prob=normalize)
    blk = _block(Qwen3MoeSparseMoeBlock, conf)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = blk(x)
    out, stats = _ours(blk, x, 2, normalize)
    torch.testing.assert_close(out.value(), want, rtol=1e-5, atol=1e-6)
    assert stats.tokens == 10 and stats.tokens_per_expert().sum() == 20       # dropless: 10 tokens x top-2
    other, _ = _ours(blk, x, 2, not normalize)
    assert not torch.allclose(other.value(), want, atol=1e-3)                 # the switch matters


def test_equals_mixtral_block():
    conf = transformers.MixtralConfig(hidden_size=H, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=2)
    blk = _block(MixtralSparseMoeBlock, conf, seed=3)
    x = torch.randn(3, 4, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = blk(x)
    torch.testing.assert_close(_ours(blk, x, 2, True)[0].value(), want, rtol=1e-5, atol=1e-6)


def test_load_balancing_loss_equals_transformers_over_layers():
    conf = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F_, num_experts=E, num_experts_per_tok=2)
    blk = _block(Qwen3MoeSparseMoeBlock, conf)
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(4))
    logits = x.reshape(-1, H) @ blk.gate.weight.detach().T
    want = load_balancing_loss_func((logits, 0.5 * logits, -logits), E, 2)
    stats = [_ours(blk, x, 2, False, scale)[1] for scale in (1.0, 0.5, -1.0)]
    torch.testing.assert_close(load_balancing_loss(stats).value(), want, rtol=1e-6, atol=0)
    # one layer's loss is not the mean of per-layer losses: the counts are pooled first
    each = sum(load_balancing_loss([s]).value() for s in stats) / 3
    assert not torch.allclose(each, want, rtol=1e-4)


def test_sigmoid_routing_with_bias_equals_reference():
    """DeepSeek-V3's router: sigmoid scores, the bias only chooses, the chosen scores renormalised."""
    g = torch.Generator().manual_seed(5)
    x, router = torch.randn(10, H, generator=g), torch.randn(H, E, generator=g)
    gate, up, down = (torch.randn(E, H, F_, generator=g), torch.randn(E, H, F_, generator=g),
                      torch.randn(E, F_, H, generator=g))
    bias = torch.tensor([2.0, -2.0, 0.0, 0.5])
    out, _ = experts(fpp.wrap(x, "tok hidden"), fpp.wrap(router, "hidden experts"), fpp.wrap(gate, "experts hidden mlp"),
                     fpp.wrap(up, "experts hidden mlp"), fpp.wrap(down, "experts mlp hidden"), top_k=2, normalize=True,
                     score="sigmoid", bias=fpp.wrap(bias, "experts"))
    scores = torch.sigmoid(x @ router)
    idx = torch.topk(scores + bias, 2, dim=-1).indices
    w = scores.gather(1, idx)
    w = w / w.sum(-1, keepdim=True)
    want = torch.zeros_like(x)
    for t in range(10):
        for j in range(2):
            e = idx[t, j]
            want[t] += w[t, j] * ((F.silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    torch.testing.assert_close(out.value(), want, rtol=1e-5, atol=1e-5)
    assert (idx == 0).any() and not (idx == 1).all()


def test_bad_input_is_refused_by_name():
    x = fpp.wrap(torch.randn(3, H), "tok hidden")
    r, w = fpp.wrap(torch.randn(H, E), "hidden experts"), fpp.wrap(torch.randn(E, H, F_), "experts hidden mlp")
    d = fpp.wrap(torch.randn(E, F_, H), "experts mlp hidden")
    with pytest.raises(ValueError, match=r"top_k=5 must be between 1 and the number of experts \(4\)"):
        experts(x, r, w, w, d, top_k=5)
    with pytest.raises(ValueError, match=r"down has dims \('experts', 'mlp', 'model'\)"):
        experts(x, r, w, w, fpp.wrap(d.data, "experts mlp model"), top_k=2)
    with pytest.raises(ValueError, match=r"score 'relu' is not one of softmax, sigmoid"):
        experts(x, r, w, w, d, top_k=2, score="relu")
    with pytest.raises(TypeError, match=r"experts: router is a Tensor"):
        experts(x, r.data, w, w, d, top_k=2)
