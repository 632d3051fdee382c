"""Gradient all-reduce buckets in a compiled step: the graph pass that applies the bucket policy
(functional_pp/parallel/buckets/__init__.py) to a traced step (docs/communication.md,
"Buckets"; docs/compile.md).

Eager steps apply the policy while autograd runs (``eager.py``, ``GradBuckets``); a compiled
step's backward is traced with one all-reduce per gradient, and :func:`bucket_all_reduces`
rewrites the graph the same way: the members of a bucket become one flat all-reduce issued
where its last member was, each member's result a view of the flat result. Each element is summed exactly as before (same
inputs, same dtype, elementwise), so results are unchanged.

A gradient is added to the open bucket only if nothing reads any member's result before it
(the graph's order must stay valid); otherwise the bucket is closed first, as eager launches a
bucket early when an op touches a pending gradient. All-reduces whose result is read at once
(tensor parallelism's activation gradients) thus stay alone.

Mechanism: Gradient buckets (the pass that groups a traced step's all-reduces; compiled).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from functional_pp.core import comm
from functional_pp.core.graph_tags import BACKWARD, TRACED
from functional_pp.parallel.buckets import bucket_capacity

_NAMESPACES = ("fpp_sim", "_c10d_functional")


def _is_wait(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "wait" in getattr(node.target, "__name__", "")


def _sum_all_reduce(node: torch.fx.Node) -> bool:
    """A traced backward sum all-reduce (simulated or torch.distributed's)."""
    custom = node.meta.get("custom") or {}
    tag = custom.get(TRACED)
    if node.op != "call_function" or tag is None or tag[0] != "all_reduce" or not custom.get(BACKWARD):
        return False
    if getattr(node.target, "namespace", None) not in _NAMESPACES or _is_wait(node):
        return False
    op = node.args[1] if len(node.args) > 1 else None
    return op in ("sum", "all_reduce_sum") and isinstance(node.meta.get("val"), torch.Tensor)


def _results(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes holding a collective's result: its waits (torch.distributed waits, sometimes
    twice) or, for a synchronous simulated collective, the node itself."""
    waits, frontier = [], [u for u in node.users if _is_wait(u)]
    while frontier:
        w = frontier.pop()
        waits.append(w)
        frontier.extend(u for u in w.users if _is_wait(u))
    return waits or [node]


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    chain = {node, *_results(node)}
    return [u for r in chain for u in r.users if u not in chain]


# meta describing a node's own values, not to be copied onto a new node (inductor lowers a
# custom op with the strides of its "eager_input_vals": a member's, not the flat buffer's)
_OWN_META = ("val", "tensor_meta", "eager_input_vals")


def _call(graph, target, args, like: torch.fx.Node, val, kwargs=None) -> torch.fx.Node:
    new = graph.call_function(target, args, kwargs)
    new.meta = {k: v for k, v in like.meta.items() if k not in _OWN_META}
    new.meta["val"] = val
    if target is like.target and "eager_input_vals" in like.meta:    # (its new inputs', for inductor)
        new.meta["eager_input_vals"] = (tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args),
                                        dict(kwargs or {}))
    return new


def _fuse(graph: torch.fx.Graph, members: list[torch.fx.Node]) -> None:
    """Replace ``members`` (same op, group and dtype) by one all-reduce of their concatenation,
    placed before the last member."""
    aten = torch.ops.aten
    last = members[-1]
    sample = last.meta["val"]
    fake = getattr(sample, "fake_mode", None)
    with graph.inserting_before(last), (fake if fake is not None else nullcontext()):
        flats = []
        for m in members:
            x = m.args[0]
            xv = x.meta["val"]
            if not xv.is_contiguous():
                x = _call(graph, aten.clone.default, (x,), m, xv.clone(memory_format=torch.contiguous_format),
                          {"memory_format": torch.contiguous_format})
                xv = x.meta["val"]
            flats.append(_call(graph, aten.view.default, (x, [-1]), m, xv.view(-1)))
        cat_val = torch.cat([f.meta["val"] for f in flats])
        cat = _call(graph, aten.cat.default, (flats,), last, cat_val)
        launch = _call(graph, last.target, (cat, *last.args[1:]), last, cat_val.new_empty(cat_val.shape),
                       dict(last.kwargs))
        kind, axes, n, _, _, dtype = last.meta["custom"][TRACED]
        nbytes = comm.ring_bytes(kind, cat_val.numel(), n, cat_val.element_size())
        launch.meta["custom"] = {**last.meta["custom"], TRACED: (kind, axes, n, nbytes, tuple(cat_val.shape), dtype)}
        result = launch
        waits = [r for r in _results(last) if r is not last]
        if waits:                    # torch.distributed: launch, then one wait on the flat result
            result = _call(graph, waits[0].target, (launch,), waits[0], cat_val.new_empty(cat_val.shape))
        offset = 0
        for m in members:
            mv = m.meta["val"]
            numel = mv.numel()
            piece = _call(graph, aten.slice.Tensor, (result, 0, offset, offset + numel), m,
                          cat_val[offset:offset + numel])
            view = _call(graph, aten.view.default, (piece, list(mv.shape)), m, piece.meta["val"].view(mv.shape))
            offset += numel
            chain = [m, *[r for r in _results(m) if r is not m]]
            for r in chain:
                r.replace_all_uses_with(view, delete_user_cb=lambda u: u not in chain)
            for r in reversed(chain):
                graph.erase_node(r)


def bucket_all_reduces(graph: torch.fx.Graph, bucket_mb: float | None) -> int:
    """Group the backward sum all-reduces of a traced step into buckets of ``bucket_mb``
    megabytes (see the module docstring); returns the number of all-reduces removed."""
    if bucket_mb is None:
        return 0
    capacity = bucket_capacity(bucket_mb)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    candidates = [n for n in graph.nodes if _sum_all_reduce(n)]
    if len(candidates) < 2:
        return 0
    done: list[list[torch.fx.Node]] = []
    open_: dict[tuple, tuple[list[torch.fx.Node], int, int]] = {}   # key: (members, bytes, first read)
    for node in candidates:
        val = node.meta["val"]
        key = (node.target, tuple(node.args[1:]), tuple(sorted(node.kwargs.items())), val.dtype, val.device)
        members, nbytes, read = open_.pop(key, ([], 0, len(pos)))
        if read < pos[node]:    # a bucket is issued where its last member is: one read already
            done.append(members)
            members, nbytes, read = [], 0, len(pos)
        members.append(node)
        nbytes += val.numel() * val.element_size()
        read = min([read, *(pos[u] for u in _readers(node))])
        if nbytes >= capacity:
            done.append(members)
        else:
            open_[key] = (members, nbytes, read)
    done.extend(members for members, _, _ in open_.values())
    removed = 0
    for members in done:
        if len(members) > 1:
            _fuse(graph, members)
            removed += len(members) - 1
    if removed:
        graph.lint()
    return removed
