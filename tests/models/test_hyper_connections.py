"""DeepSeek-V4's manifold-constrained hyper-connections (models/hyper_connections.py) equal
transformers' DeepseekV4HyperConnection, the decoder layer's stream update and DeepseekV4HyperHead
in float64: two blocks' streams and the head's output, and the gradients of the streams and of every
weight; with the weights' ``hidden`` over dp_shard (FSDP, simulated and on two gloo processes) the
same values and gradients as one device."""
import torch
import pytest

import functional_pp as fpp
from functional_pp import ops
from functional_pp.core import tree
from functional_pp.models import hyper_connections as mhc
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4  # noqa: E402

H, HC, ITERS, EPS, NORM_EPS = 16, 3, 5, 1e-6, 1e-6
DECLS = {"attn": mhc.init(H, HC, torch.float64), "ffn": mhc.init(H, HC, torch.float64),
         "head": mhc.head_init(H, HC, torch.float64), "w": fpp.param((H, H), "hidden hidden_out", dtype=torch.float64)}


def _ours(p, streams):
    """Two blocks (a tanh MLP stand-in for attention and MoE) and the head."""
    for name in ("attn", "ffn"):
        collapsed, post, comb = mhc.mix(p[name], streams, sinkhorn_iters=ITERS, eps=EPS, norm_eps=NORM_EPS)
        out = ops.rename(ops.einsum("batch seq hidden, hidden hidden_out -> batch seq hidden_out",
                                    ops.tanh(collapsed), p["w"]), hidden_out="hidden")
        streams = mhc.add_block(streams, out, post, comb)
    return mhc.head(p["head"], streams, eps=EPS, norm_eps=NORM_EPS)


def _full():
    g = torch.Generator().manual_seed(0)
    full = tree.tree_map(lambda t: t.double(), fpp.init_params(DECLS, seed=0))
    for name in ("attn", "ffn", "head"):
        for k in full[name]:
            full[name][k] = full[name][k] + 0.3 * torch.randn(full[name][k].shape, generator=g, dtype=torch.float64)
    return full


STREAMS = torch.randn(2, 4, HC, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_equals_transformers(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "float", lambda t: t if t.dtype == torch.float64 else t.to(torch.float32))
    conf = transformers.DeepseekV4Config(hidden_size=H, hc_mult=HC, hc_sinkhorn_iters=ITERS, hc_eps=EPS,
                                         rms_norm_eps=NORM_EPS, num_hidden_layers=1, vocab_size=32)
    full = _full()
    attn_hc, ffn_hc = (v4.DeepseekV4HyperConnection(conf).double() for _ in range(2))
    hc_head = v4.DeepseekV4HyperHead(conf).double()
    with torch.no_grad():
        for mod, name in ((attn_hc, "attn"), (ffn_hc, "ffn")):
            mod.fn.copy_(full[name]["fn"].reshape(-1, HC * H))
            mod.base.copy_(full[name]["base"])
            mod.scale.copy_(full[name]["scale"])
        hc_head.hc_fn.copy_(full["head"]["fn"].reshape(HC, HC * H))
        hc_head.hc_base.copy_(full["head"]["base"])
        hc_head.hc_scale.copy_(full["head"]["scale"])
    w = full["w"].clone().requires_grad_()
    x = STREAMS.clone().requires_grad_()
    streams = x
    for mod in (attn_hc, ffn_hc):                       # DeepseekV4DecoderLayer's update, its blocks the stand-in
        post, comb, collapsed = mod(streams)
        out = torch.tanh(collapsed) @ w
        streams = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    want = hc_head(streams)
    want.pow(2).sum().backward()

    leaves = tree.tree_map(lambda t: t.clone().requires_grad_(), full)
    xs = STREAMS.clone().requires_grad_()
    got = _ours(sharding.named_tree(leaves, DECLS), fpp.wrap(xs, "batch seq hc hidden")).value()
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    got.pow(2).sum().backward()
    torch.testing.assert_close(xs.grad, x.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(leaves["w"].grad, w.grad, rtol=1e-9, atol=1e-12)
    for mod, name in ((attn_hc, "attn"), (ffn_hc, "ffn")):
        torch.testing.assert_close(leaves[name]["fn"].grad.reshape(-1, HC * H), mod.fn.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(leaves[name]["base"].grad, mod.base.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(leaves[name]["scale"].grad, mod.scale.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(leaves["head"]["fn"].grad.reshape(HC, HC * H), hc_head.hc_fn.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(leaves["head"]["base"].grad, hc_head.hc_base.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(leaves["head"]["scale"].grad, hc_head.hc_scale.grad, rtol=1e-9, atol=1e-12)


def _run(mesh, rules, processes=False):
    full = _full()

    def device():
        with fpp.use_rules(rules):
            local = tree.tree_map(lambda t: t.clone().requires_grad_(),
                                  sharding.shard(full, DECLS, mesh, rules, fpp.current_rank()))
            with fpp.comm_report() as rep:
                out = _ours(sharding.named_tree(local, DECLS), fpp.named(STREAMS, "batch seq hc hidden"))
                loss = ops.sum(ops.square(out)).value()
                loss.backward()
            return (loss.detach(), fpp.gather_tree(tree.tree_map(lambda t: t.grad, local), DECLS, rules),
                    rep.bytes("all_gather"))
    return fpp.launch(device, mesh, processes=processes)


@pytest.mark.multiprocess
def test_fsdp_equals_one_device():
    (loss0, grads0, _), = _run(fpp.Mesh(), fpp.Rules())
    mesh, rules = fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard", hidden_out=None)
    for processes in (False, True):
        for loss, grads, gathered in _run(mesh, rules, processes):
            assert gathered > 0                                  # the weights' hidden gathered (FSDP)
            torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
            for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
                torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=p)
