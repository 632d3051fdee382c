"""The gated delta rule with a decay per key channel (Kimi Delta Attention: ``g`` batch seq heads
head_dim, ops/linear_attention.py) against transformers' torch fallbacks of Kimi Linear
(``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``, which compute in float32):
values and gradients, every chunk size the recurrence in float64, packed documents each as if
alone, the heads split over tp on simulated devices; at Kimi's gate with large decays (the
halving of ops/decayed_scores.py stays exact), with an initial state, and traced by torch.compile."""
import sys
from pathlib import Path

import pytest
import torch

import functional_pp as fpp
from functional_pp.ops.linear_attention import gated_delta_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

B, S, H, DK = 2, 13, 4, 8
DIMS = dict(batch="batch", seq="seq", heads="heads", kv_heads="heads", head_dim="head_dim", v_head_dim="v_head_dim")
NAMES = ("batch seq heads head_dim", "batch seq heads head_dim", "batch seq heads v_head_dim",
         "batch seq heads head_dim", "batch seq heads")


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, DK, generator=g, dtype=dtype) for _ in range(3))
    decay = -torch.rand(B, S, H, DK, generator=g, dtype=dtype) * 2        # a log decay <= 0 per key channel
    beta = torch.rand(B, S, H, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, decay, beta)]


def _ours(q, k, v, decay, beta, chunk=64, segments=None):
    seg = None if segments is None else fpp.wrap(segments, "batch seq")
    named = [fpp.wrap(t, d) for t, d in zip((q, k, v, decay, beta), NAMES)]
    return gated_delta_rule(*named, chunk=chunk, segments=seg, **DIMS).value()


def _theirs(q, k, v, decay, beta, chunk=64):
    return kimi.chunk_kimi_delta_attention(q, k, v, g=decay, beta=beta, chunk_size=chunk,
                                           use_qk_l2norm_in_kernel=True)[0]


SEGMENTS = torch.tensor([[0] * 3 + [1] * 5 + [2] * 5, [4] * 6 + [7] * 7])


@pytest.mark.parametrize("chunk", [4, 64])
def test_equals_transformers_chunk_kda_and_gradients(chunk):
    ours_in, theirs_in = _inputs(torch.float32), _inputs(torch.float32)
    got, want = _ours(*ours_in, chunk=chunk), _theirs(*theirs_in, chunk=chunk)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    (got * up).sum().backward()
    (want * up).sum().backward()
    for name, a, b in zip("q k v g beta".split(), ours_in, theirs_in):
        assert b.grad.abs().max() > 0, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


def test_float64_every_chunk_is_the_recurrence_and_a_decay_per_channel_matters():
    """In float64 every chunk size gives the chunk-of-one result (the recurrence itself), which is
    transformers' token-by-token recurrence (computed by it in float32: to that precision); the same
    decay repeated over the channels is the per-head rule's result."""
    x = _inputs(torch.float64)
    one = _ours(*x, chunk=1)
    for chunk in (3, 5, 64):
        torch.testing.assert_close(_ours(*x, chunk=chunk), one, rtol=1e-12, atol=1e-12)
    rec, _ = kimi.recurrent_kimi_delta_attention(*x[:3], g=x[3], beta=x[4], initial_state=None,
                                                 output_final_state=False, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(one, rec.to(torch.float64), rtol=1e-5, atol=1e-6)
    head = x[3][..., :1].detach()
    per_head = gated_delta_rule(*[fpp.wrap(t, d) for t, d in zip(
        (x[0], x[1], x[2], head[..., 0], x[4]), NAMES[:3] + ("batch seq heads", "batch seq heads"))],
        chunk=4, **DIMS).value()
    torch.testing.assert_close(_ours(x[0], x[1], x[2], head.expand_as(x[3]), x[4], chunk=4), per_head,
                               rtol=1e-12, atol=1e-12)
    assert not torch.allclose(one, per_head, atol=1e-3)


@pytest.mark.parametrize("chunk", [4, 64])
def test_packed_documents_each_equal_transformers_alone(chunk):
    ours_in, theirs_in = _inputs(torch.float32), _inputs(torch.float32)
    got = _ours(*ours_in, chunk=chunk, segments=SEGMENTS)
    up = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    (got * up).sum().backward()
    for b in range(B):
        for doc in SEGMENTS[b].unique():
            at = (SEGMENTS[b] == doc).nonzero().flatten()
            part = [t[b:b + 1, at] for t in theirs_in]
            want = _theirs(*part, chunk=chunk)
            torch.testing.assert_close(got[b:b + 1, at], want, rtol=1e-5, atol=1e-5)
            (want * up[b:b + 1, at]).sum().backward()
    for name, a, b in zip("q k v g beta".split(), ours_in, theirs_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


def test_heads_split_over_tp_equal_one_device_and_split_channels_refused():
    x = _inputs(torch.float64)
    want = _ours(*x, chunk=4).detach()

    def run(rules):
        def device():
            with fpp.use_rules(rules):
                return gated_delta_rule(*[fpp.named(t.detach(), d) for t, d in zip(x, NAMES)], chunk=4, **DIMS)
        return fpp.launch(device, fpp.Mesh(dp_shard=2, tp=2))
    for r, out in enumerate(run(fpp.Rules(heads="tp", batch="dp_shard"))):
        b, t = divmod(r, 2)
        torch.testing.assert_close(out.data, want[b:b + 1, :, 2 * t:2 * t + 2], rtol=1e-12, atol=1e-12)
    with pytest.raises(Exception, match="'head_dim' must not be split"):
        run(fpp.Rules(head_dim="tp", batch="dp_shard"))


def _kimi_gate(dtype, seed=1, shape=(B, S, H, DK)):
    """g as Kimi's layer makes it, -exp(A_log) softplus(.), with decay rates A per head from 0.01 to 100
    (a step's log decay down to about -1000: exp(decay_i - decay_j) over a chunk spans far beyond
    float64's range)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.logspace(-2, 2, shape[2], dtype=dtype)
    return -torch.nn.functional.softplus(torch.randn(shape, generator=gen, dtype=dtype) * 3) * a[:, None]


@pytest.mark.parametrize("segments", [None, SEGMENTS])
def test_large_decays_equal_the_recurrence_and_the_direct_form_in_float64(segments):
    """With Kimi's gate at large decay rates the halving form (ops/decayed_scores.py) stays finite and
    equals the recurrence (chunk 1) and the direct per-pair form it replaced (benchmarks/
    linear_attention_memory.py's ``cubic_scores``), values and gradients, packed documents too."""
    from linear_attention_memory import cubic_scores, scores_form
    x = _inputs(torch.float64)
    with torch.no_grad():
        x[3].copy_(_kimi_gate(torch.float64))
    assert x[3].min() < -300

    def run(chunk, form=None):
        for t in x:
            t.grad = None
        if form is None:
            out = _ours(*x, chunk=chunk, segments=segments)
        else:
            with scores_form(form):
                out = _ours(*x, chunk=chunk, segments=segments)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        return [out.detach()] + [t.grad.clone() for t in x]
    want = run(1)
    assert all(t.isfinite().all() for t in want) and want[0].abs().max() > 0.1
    for got in (run(4), run(5), run(64), run(64, cubic_scores)):
        for name, a, b in zip("out q k v g beta".split(), got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_large_decays_equal_transformers_recurrence_in_float32():
    x = _inputs(torch.float32)
    with torch.no_grad():
        x[3].copy_(_kimi_gate(torch.float32))
    got = _ours(*x, chunk=64)
    rec, _ = kimi.recurrent_kimi_delta_attention(*x[:3], g=x[3], beta=x[4], initial_state=None,
                                                 output_final_state=False, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got, rec, rtol=1e-5, atol=1e-5)


def test_initial_state_equals_transformers_recurrence_and_chunk_sizes_agree():
    """The state handed in (context parallelism's chain passes one): read by the first positions,
    decayed per channel; the output, the final state and their gradients (the state's too) agree at
    every chunk size in float64 and with transformers' recurrence (float32) given the same state."""
    from functional_pp.ops.linear_attention import chunked_gated_delta_rule
    x = _inputs(torch.float64)
    with torch.no_grad():
        x[3].copy_(_kimi_gate(torch.float64) / 20)               # decays that keep the state alive a while
    state0 = torch.randn(B, H, DK, DK, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    state0.requires_grad_()

    def run(chunk):
        for t in x + [state0]:
            t.grad = None
        out, final = chunked_gated_delta_rule(*x, chunk=chunk, initial_state=state0)
        (out.sum() + (final * final).sum()).backward()
        return [out.detach(), final.detach()] + [t.grad.clone() for t in x + [state0]]
    want = run(1)
    assert state0.grad.abs().max() > 1e-3
    for chunk in (4, 16):
        for name, a, b in zip("out final q k v g beta state".split(), run(chunk), want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    rec, final = kimi.recurrent_kimi_delta_attention(*(t.detach().float() for t in x[:3]), g=x[3].detach().float(),
                                                     beta=x[4].detach().float(), initial_state=state0.detach().float(),
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(want[0], rec.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(want[1], final.double(), rtol=1e-5, atol=1e-5)


def test_traced_by_torch_compile_equals_eager():
    """Traced (torch.compile, aot_eager) the halving is plain autograd (no recomputing function):
    the same values and gradients as eager."""
    from functional_pp.ops.linear_attention import chunked_gated_delta_rule
    x, y = _inputs(torch.float64), _inputs(torch.float64)
    compiled = torch.compile(chunked_gated_delta_rule, backend="aot_eager", fullgraph=True)
    got, want = compiled(*x, chunk=4)[0], chunked_gated_delta_rule(*y, chunk=4)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.sum().backward()
    want.sum().backward()
    for name, a, b in zip("q k v g beta".split(), x, y):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"grad {name}: {m}")
