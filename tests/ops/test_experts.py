"""ops.experts on one device: the routed experts equal transformers' own MoE blocks (Qwen3-MoE
with and without renormalised top-k weights, Mixtral), the load-balancing loss equals
transformers' ``load_balancing_loss_func`` over several layers, DeepSeek-style sigmoid routing
with a selection bias equals a plain-torch reference, and bad input is refused by name."""
import pytest
import torch
import torch.nn.functional as F

import functional_pp as fpp
from functional_pp.ops.experts import experts, load_balancing_loss, router_z_loss

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
    with pytest.raises(ValueError, match=r"capacity_factor must be a positive number"):
        experts(x, r, w, w, d, top_k=2, capacity_factor=0)


def test_router_z_loss_equals_transformers_over_layers():
    """ST-MoE's z-loss as transformers' ``router_z_loss_func`` over the layers' logits taken
    together (the mean over every layer's tokens), and its gradient through the router."""
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func
    conf = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F_, num_experts=E, num_experts_per_tok=2)
    blk = _block(Qwen3MoeSparseMoeBlock, conf)
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(4))
    scales = (1.0, 0.5, -2.0)
    router = blk.gate.weight.detach().T.contiguous().requires_grad_()
    logits = [(x.reshape(-1, H) @ router * s).reshape(2, 6, E) for s in scales]
    want = router_z_loss_func(torch.cat(logits, dim=1))
    (g_want,) = torch.autograd.grad(want, router)
    r = fpp.wrap(router, "hidden experts")
    w = fpp.wrap(torch.zeros(E, H, F_), "experts hidden mlp")
    d = fpp.wrap(torch.zeros(E, F_, H), "experts mlp hidden")
    stats = [experts(fpp.wrap(x * s, "batch seq hidden"), r, w, w, d, top_k=2)[1] for s in scales]
    got = router_z_loss(stats).value()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    (g_got,) = torch.autograd.grad(got, router)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(router_z_loss(stats[:1]).value(), want, rtol=1e-3)     # every layer counts


def _capacity_reference(x, router, gate, up, down, top_k, cap):
    """The capacity rule written out: per sequence, every expert takes at most ``cap``
    assignments, in the order (choice, position): every token's first choice before any
    second choice; the rest are dropped (their outputs omitted, weights not renormalised)."""
    R, S, _ = x.shape
    probs = torch.softmax(x @ router, dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out, dropped = torch.zeros_like(x), 0
    for r in range(R):
        taken = [0] * router.shape[1]
        for j in range(top_k):
            for s in range(S):
                e = int(idx[r, s, j])
                if taken[e] == cap:
                    dropped += 1
                    continue
                taken[e] += 1
                xe = x[r, s]
                out[r, s] = out[r, s] + w[r, s, j] * ((F.silu(xe @ gate[e]) * (xe @ up[e])) @ down[e])
    return out, dropped


def _weights(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) * 0.5
            for shape in ((H, E), (E, H, F_), (E, H, F_), (E, F_, H))]


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_equals_the_reference_rule(factor):
    """A static capacity per expert and sequence: output, drops and every gradient equal the
    rule written out as loops; ``capacity`` is ceil(factor * seq * top_k / experts)."""
    from functional_pp.ops.experts import capacity
    ws = [w.requires_grad_() for w in _weights(6)]
    x = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64).requires_grad_()
    cap = capacity(8, 2, E, factor)
    assert cap == {0.5: 2, 1.0: 4}[factor]
    want, dropped = _capacity_reference(x, *ws, 2, cap)
    out, stats = experts(fpp.wrap(x, "batch seq hidden"), *(fpp.wrap(w, d) for w, d in zip(
        ws, ("hidden experts", "experts hidden mlp", "experts hidden mlp", "experts mlp hidden"))),
        top_k=2, normalize=True, capacity_factor=factor)
    torch.testing.assert_close(out.value(), want, rtol=1e-12, atol=1e-12)
    assert dropped > 0 and stats.dropped.value().item() == dropped
    assert stats.tokens_per_expert().sum() == 3 * 8 * 2                  # routed, before the drops
    probe = torch.randn_like(want)
    g_want = torch.autograd.grad((want * probe).sum(), [x, *ws])
    g_got = torch.autograd.grad((out.value() * probe).sum(), [x, *ws])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_capacity_without_drops_equals_dropless():
    ws = [fpp.wrap(w, d) for w, d in zip(_weights(8), ("hidden experts", "experts hidden mlp", "experts hidden mlp",
                                                        "experts mlp hidden"))]
    x = fpp.wrap(torch.randn(2, 6, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64),
                 "batch seq hidden")
    want, _ = experts(x, *ws, top_k=2)
    out, stats = experts(x, *ws, top_k=2, capacity_factor=E / 2)        # capacity = seq: nothing dropped
    torch.testing.assert_close(out.value(), want.value(), rtol=1e-12, atol=1e-12)
    assert stats.dropped.value().item() == 0


def _token_capacity_reference(x, router, gate, up, down, top_k, cap):
    """Axolotl's ``expert_parallel_token_capacity`` written out: over the forward's tokens,
    each expert keeps at most ``cap`` assignments, its highest weights (ties: the earlier token,
    then choice); a token's kept weights are scaled back to their sum before the drop."""
    X = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(X @ router, dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    keep = [[True] * top_k for _ in range(X.shape[0])]
    for e in range(router.shape[1]):
        mine = sorted(((-float(w[t, j]), t, j) for t in range(X.shape[0]) for j in range(top_k) if idx[t, j] == e))
        for _, t, j in mine[cap:]:
            keep[t][j] = False
    out, dropped = torch.zeros_like(X), sum(not k for row in keep for k in row)
    for t in range(X.shape[0]):
        kept = [j for j in range(top_k) if keep[t][j]]
        if not kept:
            continue
        scale = w[t].sum() / sum(w[t, j] for j in kept)
        for j in kept:
            e = int(idx[t, j])
            out[t] = out[t] + w[t, j] * scale * ((F.silu(X[t] @ gate[e]) * (X[t] @ up[e])) @ down[e])
    return out.reshape(x.shape), dropped


@pytest.mark.parametrize("cap", [1, 3])
def test_token_capacity_equals_the_reference_rule(cap):
    """Axolotl's token capacity (expert_parallel_token_capacity): output, drops and every
    gradient equal the rule written out; a capacity above every expert's load is dropless."""
    ws = [w.requires_grad_() for w in _weights(6)]
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64).requires_grad_()
    want, dropped = _token_capacity_reference(x, *ws, 2, cap)
    named = [fpp.wrap(w, d) for w, d in zip(ws, ("hidden experts", "experts hidden mlp", "experts hidden mlp",
                                                  "experts mlp hidden"))]
    out, stats = experts(fpp.wrap(x, "batch seq hidden"), *named, top_k=2, normalize=True, token_capacity=cap)
    torch.testing.assert_close(out.value(), want, rtol=1e-12, atol=1e-12)
    assert dropped > 0 and stats.dropped.value().item() == dropped
    probe = torch.randn_like(want)
    g_want = torch.autograd.grad((want * probe).sum(), [x, *ws])
    g_got = torch.autograd.grad((out.value() * probe).sum(), [x, *ws])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    free, stats = experts(fpp.wrap(x, "batch seq hidden"), *named, top_k=2, normalize=True, token_capacity=20)
    plain, _ = experts(fpp.wrap(x, "batch seq hidden"), *named, top_k=2, normalize=True)
    torch.testing.assert_close(free.value(), plain.value(), rtol=1e-12, atol=1e-12)
    assert stats.dropped.value().item() == 0
    with pytest.raises(ValueError, match=r"token_capacity must be a positive int with dropless routing"):
        experts(fpp.wrap(x, "batch seq hidden"), *named, top_k=2, token_capacity=0)


def test_not_gated_experts_equal_nemotron_h_moe_block(monkeypatch):
    """``gate=None`` (Nemotron 3): squared-ReLU experts not gated, DeepSeek-V3's grouped sigmoid
    router with its score correction, renormalised and scaled, equal transformers' NemotronHMoE
    (its shared expert subtracted) in the output and the gradients of x, router, up and down."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE
    conf = transformers.NemotronHConfig(hidden_size=H, n_routed_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=F_, moe_shared_expert_intermediate_size=F_, n_group=4,
                                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.manual_seed(6)
    blk = NemotronHMoE(conf).double()
    with torch.no_grad():
        for p in (*blk.parameters(), blk.gate.e_score_correction_bias):
            p.copy_(0.3 * torch.randn_like(p))
    real_type = torch.Tensor.type                   # (its router computes in float32: in float64 here)
    monkeypatch.setattr(torch.Tensor, "type", lambda t, *a: real_type(t, torch.float64) if a == (torch.float32,)
                        else real_type(t, *a))
    blk.experts.config._experts_implementation = "eager"
    x = torch.randn(2, 5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(7), requires_grad=True)
    want = blk(x) - blk.shared_experts(x)
    want.pow(2).sum().backward()
    xs = x.detach().clone().requires_grad_()
    router, up, down = (blk.gate.weight.detach().T.clone().requires_grad_(),
                        blk.experts.up_proj.detach().transpose(1, 2).clone().requires_grad_(),
                        blk.experts.down_proj.detach().transpose(1, 2).clone().requires_grad_())

    def ours(activation="relu2"):
        return experts(fpp.wrap(xs, "batch seq hidden"), fpp.wrap(router, "hidden experts"), None,
                       fpp.wrap(up, "experts hidden mlp"), fpp.wrap(down, "experts mlp hidden"), top_k=2,
                       normalize=True, score="sigmoid", bias=fpp.wrap(blk.gate.e_score_correction_bias, "experts"),
                       groups=4, topk_groups=2, weight_scale=2.5, activation=activation)[0].value()
    out = ours()
    torch.testing.assert_close(out, want.detach(), rtol=1e-10, atol=1e-12)
    out.pow(2).sum().backward()
    for ours_g, theirs in ((xs.grad, x.grad), (router.grad, blk.gate.weight.grad.T),
                           (up.grad, blk.experts.up_proj.grad.transpose(1, 2)),
                           (down.grad, blk.experts.down_proj.grad.transpose(1, 2))):
        torch.testing.assert_close(ours_g, theirs, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(ours("silu"), out.detach(), atol=1e-3)            # the activation matters
    with pytest.raises(ValueError, match=r"gate=None \(experts not gated\) takes no clamp"):
        experts(fpp.wrap(xs, "batch seq hidden"), fpp.wrap(router, "hidden experts"), None,
                fpp.wrap(up, "experts hidden mlp"), fpp.wrap(down, "experts mlp hidden"), top_k=2, clamp=(1.7, 7.0))


def test_sqrtsoftplus_routing_and_silu_clamp_equal_deepseek_v4_moe_block():
    """DeepSeek-V4's top-k MoE layer (``mlp_layer_types`` ``moe``): sqrt(softplus) scores, the score
    correction only choosing, renormalised, times ``routed_scaling_factor``; experts and shared
    expert ``silu(min(g, limit)) * clamp(u)`` (``clamp=(1, limit, 0)``, ``ops.clamped_swiglu``
    with ``up_offset=0``). Equal to transformers' DeepseekV4SparseMoeBlock in float64: the output
    and the gradients of x, router, gate, up, down and the shared expert."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock
    from functional_pp import ops
    from functional_pp.ops.swiglu import clamped_swiglu
    conf = transformers.DeepseekV4Config(hidden_size=H, moe_intermediate_size=F_, n_routed_experts=E,
                                         num_experts_per_tok=2, num_hidden_layers=1, mlp_layer_types=["moe"],
                                         routed_scaling_factor=1.5, swiglu_limit=0.4, vocab_size=32)
    torch.manual_seed(8)
    blk = DeepseekV4SparseMoeBlock(conf, 0).double()
    blk.experts.config._experts_implementation = "eager"
    with torch.no_grad():
        for p in (*blk.parameters(), blk.gate.e_score_correction_bias):
            p.copy_(0.5 * torch.randn_like(p))
    x = torch.randn(2, 5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(9), requires_grad=True)
    want = blk(x)
    want.pow(2).sum().backward()
    gu = blk.experts.gate_up_proj.detach()
    xs = x.detach().clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (
        blk.gate.weight.detach().T, gu[:, :F_].transpose(1, 2), gu[:, F_:].transpose(1, 2),
        blk.experts.down_proj.detach().transpose(1, 2), blk.shared_experts.gate_proj.weight.detach().T,
        blk.shared_experts.up_proj.weight.detach().T, blk.shared_experts.down_proj.weight.detach().T)]
    router, gate, up, down, s_gate, s_up, s_down = leaves

    def ours(score="sqrtsoftplus", clamp=(1.0, 0.4, 0.0)):
        h = fpp.wrap(xs, "batch seq hidden")
        routed, _ = experts(h, fpp.wrap(router, "hidden experts"), fpp.wrap(gate, "experts hidden mlp"),
                            fpp.wrap(up, "experts hidden mlp"), fpp.wrap(down, "experts mlp hidden"), top_k=2,
                            normalize=True, score=score, bias=fpp.wrap(blk.gate.e_score_correction_bias, "experts"),
                            weight_scale=1.5, clamp=clamp)
        act = clamped_swiglu(*(ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", h, fpp.wrap(w, "hidden mlp"))
                               for w in (s_gate, s_up)), alpha=1.0, limit=0.4, up_offset=0.0)
        return (routed + ops.einsum("batch seq mlp, mlp hidden -> batch seq hidden", act,
                                    fpp.wrap(s_down, "mlp hidden"))).value()
    out = ours()
    torch.testing.assert_close(out, want.detach(), rtol=1e-10, atol=1e-12)
    out.pow(2).sum().backward()
    theirs = (blk.gate.weight.grad.T, blk.experts.gate_up_proj.grad[:, :F_].transpose(1, 2),
              blk.experts.gate_up_proj.grad[:, F_:].transpose(1, 2), blk.experts.down_proj.grad.transpose(1, 2),
              blk.shared_experts.gate_proj.weight.grad.T, blk.shared_experts.up_proj.weight.grad.T,
              blk.shared_experts.down_proj.weight.grad.T)
    torch.testing.assert_close(xs.grad, x.grad, rtol=1e-9, atol=1e-12)
    for mine, other in zip(leaves, theirs):
        torch.testing.assert_close(mine.grad, other, rtol=1e-9, atol=1e-12)
    with torch.no_grad():                                   # each switch matters
        assert not torch.allclose(ours(score="sigmoid"), out.detach(), atol=1e-3)
        assert not torch.allclose(ours(clamp=(1.0, 0.4)), out.detach(), atol=1e-3)
    with pytest.raises(ValueError, match=r"clamp must be \(alpha, limit\) or \(alpha, limit, up_offset\) numbers"):
        ours(clamp=(1.0,))


def test_chosen_experts_equal_deepseek_v4_hash_moe_block():
    """DeepSeek-V4's hash-routed layers (``mlp_layer_types`` ``hash_moe``): each token's experts
    ``tid2eid[input_ids]`` given (``chosen``), the router's sqrt(softplus) scores of them
    renormalised and scaled. Equal to transformers' DeepseekV4SparseMoeBlock (its shared expert
    subtracted) in float64: the output and the gradients of x and the router."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock
    conf = transformers.DeepseekV4Config(hidden_size=H, moe_intermediate_size=F_, n_routed_experts=E,
                                         num_experts_per_tok=2, num_hidden_layers=1, mlp_layer_types=["hash_moe"],
                                         routed_scaling_factor=1.5, swiglu_limit=0.4, vocab_size=32)
    torch.manual_seed(10)
    blk = DeepseekV4SparseMoeBlock(conf, 0).double()
    blk.experts.config._experts_implementation = "eager"
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(0.5 * torch.randn_like(p))
        blk.gate.tid2eid.copy_(torch.stack([torch.randperm(E)[:2] for _ in range(32)]))
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(11))
    x = torch.randn(2, 5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(12), requires_grad=True)
    want = blk(x, input_ids=ids) - blk.shared_experts(x)
    want.pow(2).sum().backward()
    gu = blk.experts.gate_up_proj.detach()
    xs, router = x.detach().clone().requires_grad_(), blk.gate.weight.detach().T.clone().requires_grad_()
    named = (fpp.wrap(gu[:, :F_].transpose(1, 2), "experts hidden mlp"), fpp.wrap(gu[:, F_:].transpose(1, 2),
             "experts hidden mlp"), fpp.wrap(blk.experts.down_proj.detach().transpose(1, 2), "experts mlp hidden"))

    def ours(chosen):
        return experts(fpp.wrap(xs, "batch seq hidden"), fpp.wrap(router, "hidden experts"), *named, top_k=2,
                       normalize=True, score="sqrtsoftplus", weight_scale=1.5, clamp=(1.0, 0.4, 0.0),
                       chosen=chosen)[0].value()
    out = ours(fpp.wrap(blk.gate.tid2eid[ids].transpose(0, 1), "seq batch top_k"))     # (any order of the dims)
    torch.testing.assert_close(out, want.detach(), rtol=1e-10, atol=1e-12)
    out.pow(2).sum().backward()
    torch.testing.assert_close(xs.grad, x.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(router.grad, blk.gate.weight.grad.T, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        assert not torch.allclose(ours(None), out, atol=1e-3)                  # the given choice matters
    with pytest.raises(ValueError, match=r"chosen has dims \('batch', 'seq'\).*one more of size top_k=2"):
        ours(fpp.wrap(ids, "batch seq"))
    with pytest.raises(ValueError, match=r"chosen holds expert indices 0\.\.4; each must be below the number of "
                                         r"experts \(4\)"):
        ours(fpp.wrap(torch.full((2, 5, 2), 4).index_fill(0, torch.tensor([0]), 0), "batch seq top_k"))
    with pytest.raises(ValueError, match=r"chosen \(experts given per token\) takes no bias"):
        experts(fpp.wrap(xs, "batch seq hidden"), fpp.wrap(router, "hidden experts"), *named, top_k=2,
                bias=fpp.wrap(torch.zeros(E, dtype=torch.float64), "experts"),
                chosen=fpp.wrap(blk.gate.tid2eid[ids], "batch seq top_k"))
