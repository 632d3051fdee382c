"""In-place execution of a compiled step's elementwise math (docs/compile.md, "In-place update").

AOT autograd hands the backend a functional graph: every op allocates its result. Where an
op's input dies at that op, eager code would have written into it (the optimizer's update
into the donated gradient buffers, docs/memory.md); the functional graph instead holds the
input and a new output at once, a parameter-sized temporary per foreach stage.

:func:`reinplace` rewrites such nodes to write into the dying input:

* a pointwise op (``torch.Tag.pointwise``) becomes its ``out=`` overload, writing into a
  tensor argument of the result's shape, dtype and strides that nothing reads afterwards;
* a ``_foreach_*`` op whose ``self`` list dies becomes the in-place ``_foreach_*_`` op; when
  another list dies instead (``m / denom`` with ``denom`` dead), it is split into one
  pointwise ``out=`` op per tensor (the foreach ``out=`` overloads allocate a copy).

An input qualifies only if it is a fresh intermediate: not a graph input or output, not
produced by a view (an op whose schema says its result aliases an input), and never viewed. Inductor plans buffer reuse itself; the pass is for
graphs that run op by op (``aot_eager``).
"""
from __future__ import annotations

import operator

import torch

from functional_pp._torch import OpOverload

_aten = torch.ops.aten


def _returns_alias(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value may share memory with one of its inputs."""
    if node.target is operator.getitem:
        return _returns_alias(node.args[0])
    t = node.target
    if not isinstance(t, OpOverload):
        return True                                 # higher-order ops, Python functions
    # a custom op's schema is a contract too: torch.library ops return fresh tensors
    # (collective results, the gradient barrier), so a reduce-scattered gradient is writable
    return any(r.alias_info is not None for r in t._schema.returns)


def _buffer(x):
    """The node that allocated ``x``'s memory: through ``out=`` nodes this pass wrote and
    ``getitem`` of multi-output ops; None if ``x`` may alias something else."""
    while isinstance(x, torch.fx.Node) and x.op == "call_function":
        if "out" in x.kwargs and isinstance(x.kwargs["out"], torch.fx.Node):
            x = x.kwargs["out"]
        elif x.target is operator.getitem or not _returns_alias(x):
            return x
        else:
            return None
    return None


def _fresh(x, node: torch.fx.Node, pos: dict) -> bool:
    """``x`` is an intermediate nobody reads after ``node`` and that aliases nothing."""
    root = _buffer(x)
    if root is None or _returns_alias(root):
        return False
    group, frontier = {root}, [root]          # the buffer and every out= result written into it
    while frontier:
        for u in frontier.pop().users:
            out = u.kwargs.get("out")
            if u not in group and isinstance(out, torch.fx.Node) and out in group:
                group.add(u)
                frontier.append(u)
    for m in group:
        for u in m.users:
            if u is node or u in group:
                continue
            if u.op == "output" or pos[u] > pos[node] or (_returns_alias(u) and "out" not in u.kwargs):
                return False
    return True


def _same_layout(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() == 0 and not a.is_sparse)


def _out_overload(op: OpOverload):
    """The ``out=`` overload taking exactly ``op``'s arguments plus ``out``, or None."""
    want = [(a.name, str(a.type)) for a in op._schema.arguments]
    packet = getattr(_aten, op._schema.name.split("::")[-1], None)
    for o in packet.overloads() if packet is not None else ():
        cand = getattr(packet, o)
        args = cand._schema.arguments
        if [(a.name, str(a.type)) for a in args if a.name != "out"] == want and any(
                a.name == "out" and a.alias_info is not None and a.alias_info.is_write for a in args):
            return cand
    return None


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _reinplace_pointwise(graph, node, pos) -> bool:
    op = node.target
    if torch.Tag.pointwise not in op.tags or not isinstance(_val(node), torch.Tensor):
        return False
    out_op = _out_overload(op)
    if out_op is None:
        return False
    for x in node.all_input_nodes:
        if _fresh(x, node, pos) and _same_layout(_val(x), _val(node)):
            with graph.inserting_before(node):
                new = graph.call_function(out_op, node.args, {**node.kwargs, "out": x})
            new.meta = dict(node.meta)
            pos[new] = pos[node]
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            return True
    return False


def _foreach_base(op: OpOverload):
    """The pointwise ``out=`` overload that computes one element of a ``_foreach_*`` op."""
    schema = op._schema
    packet = getattr(_aten, schema.name.split("::")[-1][len("_foreach_"):], None)
    if packet is None:
        return None
    want = [str(a.type).replace("List[Tensor]", "Tensor") for a in schema.arguments]
    for o in packet.overloads():
        cand = getattr(packet, o)
        args = [a for a in cand._schema.arguments if a.name != "out"]
        if len(args) == len(cand._schema.arguments) - 1 and [str(a.type) for a in args] == want:
            return cand
    return None


def _reinplace_foreach(graph, node, pos) -> bool:
    op = node.target
    outs = _val(node)
    lists = [i for i, a in enumerate(node.args) if isinstance(a, (list, tuple))
             and a and all(isinstance(x, torch.fx.Node) for x in a)]
    if not lists or not isinstance(outs, (list, tuple)):
        return False
    getitems = [u for u in node.users if u.target is operator.getitem]
    if len(getitems) != len(node.users):
        return False

    def dead(i):
        return all(_fresh(x, node, pos) and _same_layout(_val(x), o) for x, o in zip(node.args[i], outs))
    if lists[0] == 0 and dead(0):              # self dies: the in-place foreach kernel
        inplace = getattr(_aten, op._schema.name.split("::")[-1] + "_", None)
        inplace = getattr(inplace, op._overloadname, None) if inplace is not None else None
        if inplace is not None:
            with graph.inserting_before(node):
                new = graph.call_function(inplace, node.args, dict(node.kwargs))
            new.meta = {k: v for k, v in node.meta.items() if k != "val"}
            pos[new] = pos[node]
            for g in getitems:
                g.replace_all_uses_with(node.args[0][g.args[1]])
                graph.erase_node(g)
            graph.erase_node(node)
            return True
    target = next((i for i in lists[1:] if dead(i)), None)
    base = _foreach_base(op) if target is not None else None
    if base is None:
        return False
    by_index = {g.args[1]: g for g in getitems}
    for k in range(len(outs)):
        args = [a[k] if i in lists else a for i, a in enumerate(node.args)]
        with graph.inserting_before(node):
            new = graph.call_function(base, tuple(args), {**node.kwargs, "out": node.args[target][k]})
        new.meta = {**node.meta, "val": outs[k]}
        pos[new] = pos[node]
        if k in by_index:
            by_index[k].replace_all_uses_with(new)
            graph.erase_node(by_index[k])
    graph.erase_node(node)
    return True


def reinplace(graph: torch.fx.Graph) -> int:
    """Write elementwise results into inputs that die at the op (module docstring). Returns
    the number of nodes rewritten."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        name = node.target._schema.name.split("::")[-1]
        if name.startswith("_foreach_") and not name.endswith("_"):
            done += _reinplace_foreach(graph, node, pos)
        elif not name.endswith("_"):
            done += _reinplace_pointwise(graph, node, pos)
    if done:
        graph.lint()
    return done
