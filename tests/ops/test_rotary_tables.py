"""Rotary tables are computed once per step, also when torch.compile traces the step
(docs/rotary.md): the traced graph builds cos/sin once, behind an opaque copy, and every
layer's q and k read them."""
from __future__ import annotations

import torch

import functional_pp as fpp
from functional_pp.models import llama

CFG = llama.Config(vocab=64, hidden=16, layers=3, heads=2, kv_heads=1, mlp=32, max_seq=16,
                   tie_embeddings=False, rope_scaling=llama.Llama3Scaling(factor=8.0, original_max_position=4))


def _count(graph: torch.fx.Graph, *names: str) -> int:
    """Calls of functions or methods named ``names`` in a dynamo graph."""
    n = 0
    for node in graph.nodes:
        target = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
        if node.op in ("call_function", "call_method") and any(str(target).endswith(x) for x in names):
            n += 1
    return n


def test_a_traced_forward_builds_the_rotary_tables_once_and_equals_eager():
    params = fpp.init(llama.init, CFG, seed=0)
    ids = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": fpp.named(ids[:, :-1].contiguous(), "batch seq"),
             "labels": fpp.named(ids[:, 1:].contiguous(), "batch seq")}
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    def loss(params, batch):
        return llama.loss(params, batch, CFG).data

    with fpp.use_rules(fpp.Rules()):
        eager = loss(params, batch)
        torch._dynamo.reset()
        traced = torch.compile(loss, backend=capture, fullgraph=True)(params, batch)
        torch._dynamo.reset()
    (graph,) = graphs
    assert _count(graph, "cos") == 1 and _count(graph, "sin") == 1, "one table for 3 layers x (q, k)"
    assert _count(graph, "materialize") == 2, "cos and sin behind an opaque copy (inductor cannot inline them)"
    assert torch.equal(traced, eager)


def test_rotate_half_as_a_roll_gives_the_bits_of_chunk_neg_cat():
    """x * cos + roll(x, d/2) * (sin with its first half negated) is bitwise the rotate-half
    formula x * cos + cat(-x2, x1) * sin (docs/rotary.md)."""
    x = torch.randn(2, 6, 3, 8, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)
    with fpp.use_rules(fpp.Rules()):
        out = fpp.ops.rotary(fpp.named(x, "batch seq heads head_dim"), fpp.named(pos, "seq"), theta=100.0, head_dim="head_dim").data
    inv = fpp.ops.inverse_frequencies(8, 100.0)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    assert torch.equal(out, x * cos + torch.cat([-x2, x1], dim=-1) * sin)
