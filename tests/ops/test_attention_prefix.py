"""Continuations packed after a shared context (``ops.attention(segments=, prefix=)``, EBFT's
block-parallel rows): a query sees its own segment causally and every key before its prefix,
equal to softmax under that mask written out here; under context parallelism (balanced or
contiguous, the all-gather path) equal to one device; what it cannot combine with is refused."""
import functools
import math

import pytest
import torch

import functional_pp as fpp
from functional_pp import ops

attend = functools.partial(ops.attention, batch="b", seq="s", heads="h", kv_heads="k", head_dim="d")
B, S, H, K, D = 2, 16, 4, 2, 8
# row 0: a context of 6 tokens, then two continuations of 5 seeing its first 4 and 6 tokens
SEGMENTS = torch.tensor([[0] * 6 + [1] * 5 + [2] * 5, [0] * 10 + [1] * 6])
PREFIX = torch.tensor([[0] * 6 + [4] * 5 + [6] * 5, [0] * 10 + [3] * 6])


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, H, D, generator=g, dtype=torch.float64),
            torch.randn(B, S, K, D, generator=g, dtype=torch.float64),
            torch.randn(B, S, K, D, generator=g, dtype=torch.float64))


def reference(q, k, v, segments, prefix):
    k, v = k.repeat_interleave(H // K, 2), v.repeat_interleave(H // K, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    i = torch.arange(S)
    seen = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        for qi in range(S):
            for ki in range(qi + 1):
                seen[b, qi, ki] = bool(segments[b, ki] == segments[b, qi]) or ki < int(prefix[b, qi])
    assert seen[:, i, i].all()
    p = scores.masked_fill(~seen[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def run(q, k, v, segments, prefix, **kw):
    names = ("b s h d", "b s k d", "b s k d")
    return attend(*(fpp.named(t, n) for t, n in zip((q, k, v), names)), segments=fpp.named(segments, "b s"),
                  prefix=None if prefix is None else fpp.named(prefix, "b s"), **kw).value()


def test_one_device_equals_the_masked_reference():
    q, k, v = qkv()
    want = reference(q, k, v, SEGMENTS, PREFIX)
    torch.testing.assert_close(run(q, k, v, SEGMENTS, PREFIX), want)
    assert not torch.allclose(run(q, k, v, SEGMENTS, None), want, atol=1e-3)     # (the prefix matters)


@pytest.mark.parametrize("seq_rule", [fpp.balanced("cp"), "cp"])
def test_context_parallel_equals_one_device(seq_rule):
    q, k, v = qkv(1)
    want = reference(q, k, v, SEGMENTS, PREFIX)
    rules = fpp.Rules(b="dp_shard", s=seq_rule)

    def device():
        with fpp.use_rules(rules):
            out = fpp.gather_tree(attend(fpp.named(q, "b s h d"), fpp.named(k, "b s k d"), fpp.named(v, "b s k d"),
                                         segments=fpp.named(SEGMENTS, "b s"), prefix=fpp.named(PREFIX, "b s")))
            return out.value() if hasattr(out, "value") else out
    for got in fpp.launch(device, fpp.Mesh(dp_shard=2, cp=2)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kw,why", [({"segments": None}, "prefix .each query's shared context. needs segments"),
                                    ({"window": 3}, "prefix .continuations packed after a shared context. with "
                                                    "window is not supported"),
                                    ({"alibi_max": 8.0}, "with alibi_max is not supported")])
def test_what_the_prefix_cannot_combine_with_is_refused(kw, why):
    q, k, v = qkv()
    names = ("b s h d", "b s k d", "b s k d")
    args = {"segments": fpp.named(SEGMENTS, "b s"), **kw}
    with pytest.raises(ValueError, match=why):
        attend(*(fpp.named(t, n) for t, n in zip((q, k, v), names)), prefix=fpp.named(PREFIX, "b s"), **args)
