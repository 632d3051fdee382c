"""Sliding-window and soft-capped attention (``ops.attention(window=, softcap=)``): equal to
softmax with transformers' mask (a query at i sees keys j with i - j < window) and Gemma 2's
``softcap * tanh(scores / softcap)``, on one device, with packed segments and under context
parallelism (ring or all-gather asked for, balanced or contiguous split)."""
import functools
import math

import pytest
import torch

import functional_pp as fpp
from functional_pp import ops

attend = functools.partial(ops.attention, batch="b", seq="s", heads="h", kv_heads="k", head_dim="d")
B, S, H, K, D = 2, 16, 4, 2, 8


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, H, D, generator=g, dtype=torch.float64),
            torch.randn(B, S, K, D, generator=g, dtype=torch.float64),
            torch.randn(B, S, K, D, generator=g, dtype=torch.float64))


def reference(q, k, v, window, causal=True, segments=None, softcap=None):
    k, v = k.repeat_interleave(H // K, 2), v.repeat_interleave(H // K, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(S)
    diff = i[:, None] - i[None, :]
    window = S + 1 if window is None else window
    mask = (diff >= 0) & (diff < window) if causal else diff.abs() < window
    mask = mask[None, None]
    if segments is not None:
        mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def run(q, k, v, window, causal=True, segments=None, softcap=None):
    names = ("b s h d", "b s k d", "b s k d")
    seg = None if segments is None else fpp.named(segments, "b s")
    return attend(*(fpp.named(t, n) for t, n in zip((q, k, v), names)), causal=causal, window=window,
                  segments=seg, softcap=softcap).value()


@pytest.mark.parametrize("window", [1, 3, 7])
@pytest.mark.parametrize("causal", [True, False])
def test_one_device_equals_the_masked_reference(window, causal):
    q, k, v = qkv()
    torch.testing.assert_close(run(q, k, v, window, causal), reference(q, k, v, window, causal))


def test_window_as_long_as_the_sequence_is_full_causal_attention():
    q, k, v = qkv(1)
    torch.testing.assert_close(run(q, k, v, S), run(q, k, v, None))
    assert not torch.allclose(run(q, k, v, S - 1), run(q, k, v, None))


def test_with_packed_segments():
    q, k, v = qkv(2)
    seg = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    torch.testing.assert_close(run(q, k, v, 4, segments=seg), reference(q, k, v, 4, segments=seg))


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_segments", [False, True])
def test_softcap_one_device(window, causal, with_segments):
    q, k, v = (t * 3 for t in qkv(4))          # large scores: the cap matters
    seg = torch.tensor([[0] * 5 + [1] * 11, [0] * 16]) if with_segments else None
    want = reference(q, k, v, window, causal, seg, softcap=2.0)
    torch.testing.assert_close(run(q, k, v, window, causal, seg, softcap=2.0), want)
    assert not torch.allclose(run(q, k, v, window, causal, seg), want, atol=1e-3)


@pytest.mark.parametrize("seq_rule,cp_attention", [(fpp.balanced("cp"), "ring"), ("cp", "allgather"),
                                                   ("cp", "ring")])
@pytest.mark.parametrize("with_segments", [False, True])
@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (5, 2.0)])
def test_context_parallel_equals_one_device(seq_rule, cp_attention, with_segments, window, softcap):
    q, k, v = qkv(3)
    seg = torch.tensor([[0] * 9 + [1] * 7, [0] * 3 + [1] * 13]) if with_segments else None
    want = reference(q, k, v, window, segments=seg, softcap=softcap)
    rules = fpp.Rules(b="dp_shard", s=seq_rule)
    mesh = fpp.Mesh(dp_shard=2, cp=2)

    def device():
        with fpp.use_rules(rules), fpp.configure(cp_attention=cp_attention):
            out = fpp.gather_tree(attend(fpp.named(q, "b s h d"), fpp.named(k, "b s k d"), fpp.named(v, "b s k d"),
                                         window=window, softcap=softcap,
                                         segments=None if seg is None else fpp.named(seg, "b s")))
            return out.value() if hasattr(out, "value") else out
    for got in fpp.launch(device, mesh):
        torch.testing.assert_close(got, want)


def test_bad_window_is_refused():
    q, k, v = qkv()
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive integer"):
            run(q, k, v, bad)
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match="softcap must be a positive number"):
            run(q, k, v, None, softcap=bad)


def test_on_meta_tensors_as_the_dry_run():
    """The planner's dry-run (meta tensors, flash-like attention) runs a windowed layer."""
    q, k, v = (t.to("meta") for t in qkv())
    assert run(q, k, v, 4).shape == (B, S, H, D)
    assert run(q, k, v, 4, softcap=30.0).shape == (B, S, H, D)
