"""The gated delta rule and the causal convolution (ops/linear_attention.py) against transformers'
torch fallbacks (``torch_chunk_gated_delta_rule``, which computes in float32, and
``causal_conv1d_fn``), their gradients, the chunking, tensor parallelism over the heads on
simulated devices, and the sequence split over context parallelism (cp=2, balanced or contiguous,
packed rows) equal to one device."""
import pytest
import torch

import functional_pp as fpp
from functional_pp.ops.linear_attention import causal_conv1d, gated_delta_rule

qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

B, S, HK, H, DK, DV, K = 2, 13, 2, 4, 8, 6, 4
DIMS = dict(batch="batch", seq="seq", heads="heads", kv_heads="kv_heads", head_dim="head_dim",
            v_head_dim="v_head_dim")


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, HK, DK, generator=g, dtype=dtype)
    k = torch.randn(B, S, HK, DK, generator=g, dtype=dtype)
    v = torch.randn(B, S, H, DV, generator=g, dtype=dtype)
    decay = -torch.rand(B, S, H, generator=g, dtype=dtype) * 2            # log decays <= 0
    beta = torch.rand(B, S, H, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, decay, beta)]


def _ours(q, k, v, decay, beta, chunk=64, segments=None):
    seg = None if segments is None else fpp.wrap(segments, "batch seq")
    return gated_delta_rule(fpp.wrap(q, "batch seq kv_heads head_dim"), fpp.wrap(k, "batch seq kv_heads head_dim"),
                            fpp.wrap(v, "batch seq heads v_head_dim"), fpp.wrap(decay, "batch seq heads"),
                            fpp.wrap(beta, "batch seq heads"), chunk=chunk, segments=seg, **DIMS).value()


# packed rows: documents of 3, 5 and 5 positions, and of 6 and 7 (boundaries inside and at the edges of chunks of 4)
SEGMENTS = torch.tensor([[0] * 3 + [1] * 5 + [2] * 5, [4] * 6 + [7] * 7])


def _documents(segments):
    for b in range(B):
        for doc in segments[b].unique():
            yield b, (segments[b] == doc).nonzero().flatten()


@pytest.mark.parametrize("chunk", [4, 64])
def test_equals_transformers_chunked_rule_and_gradients(chunk):
    ours_in, theirs_in = _inputs(torch.float32), _inputs(torch.float32)
    got = _ours(*ours_in, chunk=chunk)
    want, _ = qwen.torch_chunk_gated_delta_rule(*theirs_in[:3], g=theirs_in[3], beta=theirs_in[4], chunk_size=chunk,
                                                use_qk_l2norm_in_kernel=True)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    (got * up).sum().backward()
    (want * up).sum().backward()
    for name, a, b in zip("q k v g beta".split(), ours_in, theirs_in):
        assert b.grad.abs().max() > 0, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


def test_float64_chunking_is_the_recurrence():
    """In float64 the chunked form equals transformers' token-by-token recurrence (run in float32
    by transformers: equal to its precision) and every chunk size gives the same result."""
    x = _inputs(torch.float64)
    one = _ours(*x, chunk=1)                        # chunks of one position: the recurrence itself
    for chunk in (3, 5, 64):
        torch.testing.assert_close(_ours(*x, chunk=chunk), one, rtol=1e-12, atol=1e-12)
    rec, _ = qwen.torch_recurrent_gated_delta_rule(*x[:3], g=x[3], beta=x[4], use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(one, rec.to(torch.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [4, 64])
def test_packed_documents_each_equal_transformers_alone(chunk):
    """With ``segments`` each document of a packed row equals transformers' rule on that document
    alone, values and gradients."""
    ours_in, theirs_in = _inputs(torch.float32), _inputs(torch.float32)
    got = _ours(*ours_in, chunk=chunk, segments=SEGMENTS)
    up = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    (got * up).sum().backward()
    for b, at in _documents(SEGMENTS):
        part = [t[b:b + 1, at] for t in theirs_in]
        want, _ = qwen.torch_chunk_gated_delta_rule(*part[:3], g=part[3], beta=part[4], chunk_size=chunk,
                                                    use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(got[b:b + 1, at], want, rtol=1e-5, atol=1e-5)
        (want * up[b:b + 1, at]).sum().backward()
    for name, a, b in zip("q k v g beta".split(), ours_in, theirs_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")
    plain = _ours(*[t.detach() for t in ours_in], chunk=chunk)
    assert not torch.allclose(plain, got.detach(), atol=1e-3)          # (the documents do mix without segments)


def test_causal_conv1d_equals_transformers():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, HK, DK, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(HK, DK, K, generator=g, dtype=torch.float64, requires_grad=True)
    got = causal_conv1d(fpp.wrap(x, "batch seq kv_heads head_dim"), fpp.wrap(w, "kv_heads head_dim kernel"),
                        seq="seq", kernel="kernel").value()
    want = qwen.causal_conv1d_fn(x.reshape(B, S, -1).transpose(1, 2), w.reshape(-1, K)).transpose(1, 2)
    torch.testing.assert_close(got.reshape(B, S, -1), want, rtol=1e-12, atol=1e-12)
    got.sum().backward()
    assert w.grad.abs().max() > 0
    packed = causal_conv1d(fpp.wrap(x, "batch seq kv_heads head_dim"), fpp.wrap(w, "kv_heads head_dim kernel"),
                           seq="seq", kernel="kernel", segments=fpp.wrap(SEGMENTS, "batch seq")).value()
    for b, at in _documents(SEGMENTS):
        alone = qwen.causal_conv1d_fn(x[b:b + 1, at].reshape(1, len(at), -1).transpose(1, 2), w.reshape(-1, K))
        torch.testing.assert_close(packed[b:b + 1, at].reshape(1, len(at), -1), alone.transpose(1, 2), rtol=1e-12,
                                   atol=1e-12)


def _on_mesh(mesh, rules, x):
    def device():
        with fpp.use_rules(rules):
            named = [fpp.named(t.detach(), d) for t, d in zip(x, ("batch seq kv_heads head_dim",) * 2 + (
                "batch seq heads v_head_dim", "batch seq heads", "batch seq heads"))]
            return gated_delta_rule(*named, chunk=4, **DIMS)
    return fpp.launch(device, mesh)


def test_heads_split_over_tp_equal_one_device():
    x = _inputs(torch.float64)
    want = _ours(*x, chunk=4).detach()
    rules = fpp.Rules(heads="tp", kv_heads="tp", batch="dp_shard")
    outs = _on_mesh(fpp.Mesh(dp_shard=2, tp=2), rules, x)
    for r, out in enumerate(outs):
        assert out.split[out.dims.index("heads")] == ("tp",)
        b, t = divmod(r, 2)
        torch.testing.assert_close(out.data, want[b:b + 1, :, 2 * t:2 * t + 2], rtol=1e-12, atol=1e-12)


# packed rows of 16: a document crossing each block boundary (4 blocks of 4 under balanced cp=2), one that does not
CP_SEGMENTS = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [4] * 8 + [7] * 8])
QKVGB = ("batch seq kv_heads head_dim",) * 2 + ("batch seq heads v_head_dim", "batch seq heads", "batch seq heads")


def _cp_inputs():
    return [torch.cat([t, t[:, :3] * 0.5], 1).detach().requires_grad_() for t in _inputs(torch.float64)]   # seq 16


def _cp_run(op, x, dims, up, out_dims, segments, mesh, rules):
    """Per device: ``op``'s output block and the gradients of (output . up) for the whole inputs."""
    def device():
        with fpp.use_rules(rules):
            leaves = [t.detach().clone().requires_grad_() for t in x]
            out = op(*(fpp.named(t, d) for t, d in zip(leaves, dims)),
                     segments=None if segments is None else fpp.named(segments, "batch seq"))
            u = fpp.named(up, out_dims)
            assert out.split == u.split
            (out.data * u.data).sum().backward()
            return [l.grad for l in leaves]
    return fpp.launch(device, mesh)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("order", ["balanced", "contiguous"])
def test_sequence_split_over_cp_equals_one_device(order, packed):
    """The rule and the convolution with the sequence split over cp (the chain of blocks, each from the
    state the block before ended in: ops/sequence_chain.py), load-balanced or contiguous, packed rows or
    not, and with the heads over tp: the gradients of every input equal one device's."""
    seg = CP_SEGMENTS if packed else None
    seq = fpp.balanced("cp") if order == "balanced" else "cp"
    up = torch.randn(B, 16, H, DV, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x = _cp_inputs()
    (_ours(*x, chunk=4, segments=seg) * up).sum().backward()

    def rule(*t, segments):
        return gated_delta_rule(*t, chunk=4, segments=segments, **DIMS)
    for mesh, rules in ((fpp.Mesh(cp=2), fpp.Rules(seq=seq)), (fpp.Mesh(cp=2, tp=2),
                                                               fpp.Rules(seq=seq, heads="tp", kv_heads="tp"))):
        for grads in _cp_run(rule, x, QKVGB, up, "batch seq heads v_head_dim", seg, mesh, rules):
            for name, a, b in zip("q k v g beta".split(), grads, x):
                torch.testing.assert_close(a, b.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"grad {name}: {m}")
    xc = torch.randn(B, 16, HK, DK, dtype=torch.float64, requires_grad=True)
    w = torch.randn(HK, DK, K, dtype=torch.float64, requires_grad=True)
    upc = torch.randn(B, 16, HK, DK, dtype=torch.float64)
    conv = (causal_conv1d(fpp.wrap(xc, "batch seq kv_heads head_dim"), fpp.wrap(w, "kv_heads head_dim kernel"),
                          seq="seq", kernel="kernel", segments=None if seg is None else fpp.wrap(seg, "batch seq")))
    (conv.value() * upc).sum().backward()

    def conv_op(x, w, segments):
        return causal_conv1d(x, w, seq="seq", kernel="kernel", segments=segments)
    for grads in _cp_run(conv_op, [xc, w], ("batch seq kv_heads head_dim", "kv_heads head_dim kernel"), upc,
                         "batch seq kv_heads head_dim", seg, fpp.Mesh(cp=2), fpp.Rules(seq=seq)):
        for name, a, b in zip(("x", "weight"), grads, (xc, w)):
            torch.testing.assert_close(a, b.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"conv grad {name}: {m}")


def test_the_chain_sends_each_hop_the_state_once_each_way():
    """docs/communication.md: under load-balanced cp=2 the chain has 2 hops (device 0 to 1, then 1 to 0):
    each device sends the state (batch x heads x head_dim x v_head_dim) once forward and its gradient
    once backward, and nothing else over cp."""
    x = _cp_inputs()

    def device():
        with fpp.use_rules(fpp.Rules(seq=fpp.balanced("cp"))):
            named = [fpp.named(t.detach().clone().requires_grad_(), d) for t, d in zip(x, QKVGB)]
            with fpp.comm_report() as rep:
                out = gated_delta_rule(*named, chunk=4, **DIMS)
                out.data.sum().backward()
            return [(e.kind, e.bytes_sent, e.backward) for e in rep.events if e.kind == "permute"]
    state = B * H * DK * DV * 8
    for events in fpp.launch(device, fpp.Mesh(cp=2)):
        assert sorted(events) == [("permute", state, False), ("permute", state, True)]
