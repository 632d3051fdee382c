"""Recomputation inside a compiled step (docs/compile.md).

A compiled step is one graph: forward, backward (traced from ``torch.autograd.grad``) and
the optimizer. A value the forward computes and the backward uses stays alive in between.
Two kinds of values are better recomputed by the backward than kept:

* an FSDP weight all-gathered in forward (ZeRO-3: keep the shard, gather again), tagged by
  FSDP around the gather (``regather_region``, functional_pp/parallel/fsdp/graph.py); the views
  and casts after it join its region;
* every activation of a remat region (:func:`functional_pp.remat`, a declared layer under
  ``train_step(remat=True)``), tagged by :func:`remat_region`; in a selective region
  (``remat="selective"``, :mod:`functional_pp.compile.selective`) the results of matrix
  products and attention are kept and only the other members are recomputed (under
  ``"selective_alternate"`` every second matrix product too).

:func:`reissue_for_backward` rewrites the graph: for each region, the members the backward
uses are computed again (from the region's inputs and kept outputs) right before the first
backward node that needs them, so the forward copies die at their last forward use. This is
SimpleFSDP's must-recompute tagging, applied to the single traced graph instead of a
forward/backward partition.

The pass is FSDP's and activation checkpointing's alike: it knows tags, not mechanisms.

A function compiled on its own and differentiated by autograd (a ``compile="per_layer"``
layer) is split into a forward and a backward graph by AOT autograd's partitioner, which
never recomputes a collective on its own: it would save every gathered weight from the
layer's forward to its backward. :func:`regather_in_backward` runs on that joint graph before
the partition and marks the ``REGATHER`` regions (the gather and its views and casts) as
must-recompute, as SimpleFSDP's selective checkpoint policy does: the forward saves the shard
and the backward gathers it again (ZeRO-3), as eager does.

Mechanism: Activation checkpointing (remat regions recomputed; compiled).
"""
from __future__ import annotations

import functools
from contextlib import nullcontext

import torch

from functional_pp._torch import (annotate, dynamo_marks_backward_nodes, is_backward_node, is_tracing,
                                  joint_forward_nodes, recompute_in_backward)
from functional_pp.compile.selective import MATMULS, keeps_matmul, saves
from functional_pp.core.graph_tags import (BACKWARD, LEAF, RECOMPUTED, REGATHER, REMAT,  # noqa: F401 (re-exported)
                                           SELECTIVE)
from functional_pp.core.runtime import per_thread

_local = per_thread("compile.recompute")

# ops that only view or convert a value: they join the region of their (single) input (and the
# passes that move nodes treat them as free)
VIEW_OR_CAST = {
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze",
    "squeeze", "alias", "slice", "select", "split", "split_with_sizes", "as_strided", "clone",
    "detach", "_to_copy", "convert_element_type", "contiguous", "unbind", "getitem",
}


def reset_region_ids() -> None:
    """Number this thread's regions from 0 again. Called before each call of a compiled step
    (outside the graph): dynamo guards on the counter's state, so a counter that kept running
    would recompile the step on every call. The counter is a one-element list, which every
    supported dynamo traces (torch 2.11's cannot call ``next`` on an ``itertools.count`` made
    outside the compiled function)."""
    _local.ids = [0]


def tag_region(key: str, enabled: bool = True, **extra: object):
    """Context that tags the nodes traced inside it as one region ``key``
    (functional_pp/core/graph_tags.py: ``REGATHER``, ``REMAT``, ``LEAF``), numbered on this
    thread, for :func:`reissue_for_backward`; nothing when not ``enabled`` or not tracing."""
    if not (enabled and is_tracing()):
        return nullcontext()
    ids = getattr(_local, "ids", None)
    if ids is None:
        ids = _local.ids = [0]
    n = ids[0]
    ids[0] = n + 1
    return annotate({key: n, **extra})


def recomputed_leaf():
    """Context for a parameter made differentiable inside a compiled step as ``p + seed``
    (torch 2.11's path, _torch/grad_leaves.py): under compile, backward computes it again from
    the step's inputs (as a regathered weight) instead of keeping the forward's copy."""
    return tag_region(LEAF)


def remat_region(selective: bool | str = False):
    """Context for a region whose activations backward recomputes (under compile); with
    ``selective`` (True or a policy of :data:`~functional_pp.compile.selective.POLICIES`) the
    results the policy keeps (matrix products and attention) are kept instead."""
    return tag_region(REMAT, **({SELECTIVE: "selective" if selective is True else selective} if selective else {}))


def backward_region():
    """Context around a step's ``torch.autograd.grad``: under compile, its nodes (collectives
    included) are marked as backward."""
    if not is_tracing():
        return nullcontext()
    return annotate({BACKWARD: True})       # a constant: no side effect inside dynamo's HOPs


def traced_as_backward(backward):
    """Decorator for an autograd Function's ``backward``: dynamo traces it while tracing the
    forward, so its collectives are marked as backward explicitly."""
    @functools.wraps(backward)
    def wrapped(*args):
        with backward_region():
            return backward(*args)
    return wrapped


def in_backward_region(node: torch.fx.Node) -> bool:
    return BACKWARD in (node.meta.get("custom") or {})


def probe_backward_marks() -> None:
    """Probe :func:`dynamo_marks_backward_nodes` now, on the host, before a compilation whose
    passes ask for it (the probe compiles, which it cannot do inside another compilation)."""
    if not is_tracing():        # this thread compiles: too late (and then already probed)
        dynamo_marks_backward_nodes()


def is_backward(node: torch.fx.Node) -> bool:
    """Whether a node of a traced step belongs to its backward: tagged by
    :func:`backward_region` (a natively traced step, step/native_trace.py, or torch 2.11's
    dynamo), or marked so by dynamo (torch 2.12 on, ``FPP_STEP_TRACE=dynamo``)."""
    return in_backward_region(node) or (dynamo_marks_backward_nodes() and is_backward_node(node))


def _region(node: torch.fx.Node):
    custom = node.meta.get("custom") or {}
    if REMAT in custom:
        return (REMAT, custom[REMAT])
    if REGATHER in custom:
        return (REGATHER, custom[REGATHER])
    if LEAF in custom:
        return (LEAF, custom[LEAF])
    return None


def _selective(node: torch.fx.Node) -> str | None:
    """The selective policy of a node's region (``"selective"``, ``"selective_alternate"``), or None."""
    tag = (node.meta.get("custom") or {}).get(SELECTIVE)
    return ("selective" if tag is True else tag) or None


def op_name(node: torch.fx.Node) -> str:
    """The ATen op a node calls, without overload (``"view"``, ``"getitem"``, ...)."""
    t = node.target
    if t is __import__("operator").getitem:
        return "getitem"
    name = getattr(t, "__name__", str(t))
    return name.split(".")[0]


# views that share their input's storage (``_unsafe_view`` too, although its schema does not
# say so): a view of a kept result is kept with it
_VIEWS = VIEW_OR_CAST - {"clone", "_to_copy", "convert_element_type", "contiguous"}


def _selectively_kept(members: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The members of a selective region that backward reads instead of recomputing: the
    results of the ops :func:`~functional_pp.compile.selective.saves` keeps, and the views of
    them. Recomputing such a view would be free, but the forward view would then die early and
    the in-place pass (compile/reinplace.py) could write into the kept storage through it.
    Under ``"selective_alternate"`` the region's 2nd, 4th, ... matrix product (graph order, the
    order eager issues them) is recomputed."""
    kept: set = set()
    matmuls = 0
    for n in members:                   # graph order: a view comes after what it views
        policy_name = _selective(n)
        if policy_name is None:
            continue
        if n.target in MATMULS:
            matmuls += 1
            if not keeps_matmul(policy_name, matmuls):
                continue
        if saves(n.target) or (op_name(n) in _VIEWS and n.all_input_nodes
                               and all(a in kept for a in _tensor_inputs(n))):
            kept.add(n)
    return kept


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes]


def regather_in_backward(graph: torch.fx.Graph) -> int:
    """In AOT autograd's joint graph of a compiled function, mark the forward's ``REGATHER``
    regions (FSDP weights' all-gathers, and the views and casts of their results) so that the
    partitioner recomputes them in backward instead of saving the gathered weights (see the
    module docstring). Returns the number of nodes marked."""
    marked: set = set()
    for n in joint_forward_nodes(graph):
        if n.op != "call_function":
            continue
        ins = _tensor_inputs(n)
        if REGATHER in (n.meta.get("custom") or {}) or (
                op_name(n) in VIEW_OR_CAST and ins and all(a in marked for a in ins)):
            recompute_in_backward(n)
            marked.add(n)
    return len(marked)


def reissue_for_backward(graph: torch.fx.Graph) -> int:
    """Recompute tagged forward values for their backward uses (see the module docstring).
    Returns the number of nodes inserted."""
    nodes = list(graph.nodes)
    first_bwd = next((i for i, n in enumerate(nodes) if is_backward(n)), None)
    if first_bwd is None:
        return 0
    pos = {n: i for i, n in enumerate(nodes)}
    regions: dict = {}
    region_of: dict = {}
    for n in nodes[:first_bwd]:
        if n.op != "call_function":
            continue
        r = _region(n)
        if r is None and op_name(n) in VIEW_OR_CAST:     # views/casts of a regathered weight
            ins = _tensor_inputs(n)
            rs = {region_of.get(a) for a in ins}
            if len(rs) == 1 and None not in rs and next(iter(rs))[0] in (REGATHER, LEAF):
                r = next(iter(rs))
        if r is not None:
            region_of[n] = r
            regions.setdefault(r, []).append(n)
    inserted = 0
    # seeded leaves last: the copies made for the other regions read them in backward too
    order = [r for r in regions if r[0] != LEAF] + [r for r in regions if r[0] == LEAF]
    for i, r in enumerate(order):
        members = regions[r]
        if r[0] == LEAF and (i == 0 or order[i - 1][0] != LEAF):
            pos = {n: j for j, n in enumerate(graph.nodes)}     # with the copies inserted so far
        member_set = set(members)
        # a region's outputs (used by later forward code outside it) are kept, as eager
        # checkpointing keeps a checkpointed function's result
        kept = {n for n in members if r[0] == REMAT and any(
            pos[u] < first_bwd and u not in member_set for u in n.users)}
        if r[0] == REMAT:
            kept |= _selectively_kept(members)
        uses = [(u, n) for n in members if n not in kept for u in list(n.users) if pos[u] >= first_bwd]
        if not uses:
            continue
        anchor = min((u for u, _ in uses), key=lambda u: pos[u])
        copies: dict = {}

        def clone(n):
            if not isinstance(n, torch.fx.Node) or n not in member_set or n in kept:
                return n
            if n not in copies:
                new = graph.node_copy(n, clone)
                new.meta = dict(n.meta)
                new.meta[RECOMPUTED] = r[0]        # the kind of region: REGATHER, REMAT or LEAF
                new.meta["custom"] = {**(n.meta.get("custom") or {}), BACKWARD: True}
                copies[n] = new
            return copies[n]
        with graph.inserting_before(anchor):
            for u, n in uses:
                u.replace_input_with(n, clone(n))
        inserted += len(copies)
    if inserted:
        graph.lint()
    return inserted


def count_recomputed(graph: torch.fx.Graph) -> int:
    """Nodes the backward recomputes (re-gathers, remat), not counting the seeded leaves'
    copies (``p + seed`` again: no work a step without the seed would not do)."""
    return sum(1 for n in graph.nodes if n.meta.get(RECOMPUTED) not in (None, False, LEAF))


def saved_bytes(graph: torch.fx.Graph) -> int:
    """Bytes of forward values that a traced step keeps for its backward (alive when the
    first backward node runs), each storage counted once; graph inputs are not counted."""
    nodes = list(graph.nodes)
    first_bwd = next((i for i, n in enumerate(nodes) if is_backward(n)), None)
    if first_bwd is None:
        return 0
    pos = {n: i for i, n in enumerate(nodes)}

    def storages(n):
        val = n.meta.get("val")
        return [v.untyped_storage() for v in (val if isinstance(val, (list, tuple)) else [val])
                if isinstance(v, torch.Tensor)]
    seen = {s._cdata for n in nodes if n.op == "placeholder" for s in storages(n)}
    total = 0
    for n in nodes[:first_bwd]:
        if n.op != "call_function" or not any(pos[u] >= first_bwd for u in n.users):
            continue
        for st in storages(n):
            if st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
    return total
