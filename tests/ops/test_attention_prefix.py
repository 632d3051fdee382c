"""Continuations packed after a shared context (``ops.attention(segments=, prefix=)``, EBFT's
block-parallel rows): a query sees its own segment causally and every key before its prefix,
equal to softmax under that mask written out here; under context parallelism (balanced or
contiguous, the all-gather path) equal to one device, computed by blocks of queries
(ops/query_chunks.py) with the same values and gradients and memory linear in the row; what it
cannot combine with is refused."""
import functools
import math

import pytest
import torch

import functional_pp as fpp
from functional_pp import ops
from functional_pp.ops import query_chunks

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


def test_blocks_of_queries_give_the_reference_values_and_gradients(monkeypatch):
    """Blocks of 5 of the 16 queries, each against the keys up to its last query and recomputed in
    backward: the values and the gradients of q, k and v of the whole mask."""
    monkeypatch.setattr(query_chunks, "QUERY_CHUNK", 5)
    q, k, v = (t.requires_grad_() for t in qkv(2))
    cot = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = reference(q, k, v, SEGMENTS, PREFIX)
    got = run(q, k, v, SEGMENTS, PREFIX)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad((got * cot).sum(), (q, k, v)),
                               torch.autograd.grad((want * cot).sum(), (q, k, v)))


def test_blocks_of_queries_under_context_parallelism_equal_one_device(monkeypatch):
    """Blocks of 3 of a device's 8 queries (cp 2, load-balanced: against every gathered key)."""
    monkeypatch.setattr(query_chunks, "QUERY_CHUNK", 3)
    test_context_parallel_equals_one_device(fpp.balanced("cp"))


def test_the_mask_is_built_by_blocks_of_queries_memory_linear_in_the_row():
    """Forward + backward of one row of 4096 tokens (a context, then 64 continuations): the peak
    stays under 10 bytes per entry of one block's mask (512 queries x 4096 keys: its booleans,
    SDPA's float copy, the kernel's buffers; 18.3 MiB measured), where the whole mask of 4096 x
    4096 took 144 MiB (booleans 16 MiB, SDPA's float copy 64 MiB, saved for backward)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from memtrack import peak_memory
    L, ctx, h, d = 4096, 1024, 2, 8
    seg = torch.cat([torch.zeros(ctx, dtype=torch.long), torch.arange(1, 65).repeat_interleave((L - ctx) // 64)])
    pre = torch.cat([torch.zeros(ctx, dtype=torch.long), torch.arange(64).repeat_interleave((L - ctx) // 64) * 16])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, L, h, d, generator=g).requires_grad_() for _ in range(3))
    names = ("b s h d", "b s k d", "b s k d")
    with peak_memory() as p:
        out = attend(*(fpp.named(t, n) for t, n in zip((q, k, v), names)), segments=fpp.named(seg[None], "b s"),
                     prefix=fpp.named(pre[None], "b s")).value()
        out.sum().backward()
    assert p.bytes < 10 * query_chunks.QUERY_CHUNK * L


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
