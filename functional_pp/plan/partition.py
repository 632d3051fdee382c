"""What a ``torch.compile``'d layer saves for backward: AOTAutograd's min-cut partitioner
(``min_cut_rematerialization_partition``, inductor's default) replayed on the ops the dry-run
recorded for one layer's forward (docs/planning.md, "Compiled layers").

The partitioner keeps the cheapest set of forward values from which backward can recompute
everything it reads: a value may be recomputed in backward only when its op is in the
recomputable list (pointwise ops, views, casts, cheap reductions; never a matrix product,
attention, a random op or a collective), it is not read in backward by an op that cannot fuse
it (the input of a matrix product, whose weight gradient reads it whole), and it is not a
reduction whose result is 4x smaller than its inputs (a norm's statistics). Saving a value
costs its bytes, twice them when every forward user could fuse it (it would otherwise never
be materialized); parameters are free. The layer's inputs are values of the region that
cannot be recomputed. The cut is a minimum s-t cut, as the partitioner's (``networkx``).

Under selective checkpointing (torchtitan's policy under compile) the policy's kept results
cannot be recomputed and every other op is recomputed; what backward reads is then what it
reads without checkpointing (learnt from a run of the layer without it, by position), so a
kept result nothing in backward reads (the last matmul's, added to the residual) is not saved."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: ATen ops (by packet name) the partitioner may recompute, besides pointwise ops and views
#: (torch/_functorch/partitioners.py ``get_default_op_list``)
RECOMPUTABLE = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "clone", "_to_copy", "to", "type_as",
    "full_like", "zeros_like", "ones_like", "empty_like", "full", "zeros", "ones", "empty", "arange",
    "scalar_tensor", "new_zeros", "lift_fresh_copy", "triu", "isinf", "any", "argmax", "maximum", "index",
    "gather", "_unsafe_view", "reshape", "expand", "broadcast_tensors", "cat", "squeeze", "unsqueeze", "alias",
    "view", "slice", "t", "permute", "select", "split", "as_strided", "where", "_grad_sum_to_size",
    "sum_to_size", "rsub"})
#: random ops: never recomputed (the partitioner's ``random_ops``)
RANDOM = frozenset({"native_dropout", "rand_like", "randn_like", "bernoulli", "rand", "randn"})


def recomputable(func) -> bool:
    """Whether the partitioner may recompute ``func``'s output in backward."""
    name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    if name in RANDOM:
        return False
    if name in RECOMPUTABLE or getattr(func, "is_view", False):
        return True
    return torch.Tag.pointwise in getattr(func, "tags", ())


@dataclass
class Value:
    """A forward value of one layer (a storage): its bytes, how it was made and who reads it."""
    nbytes: int
    recomputable: bool = False         # its op may be recomputed (False for the layer's inputs)
    inputs: tuple[int, ...] = ()       # the values its op read
    free: bool = False                 # a parameter or a copy of one: free to save
    primal: bool = False               # made outside the layer (its input)
    needed: bool = False               # autograd saved it: backward reads it
    read_by_unfusible: bool = False    # an input of a forward op that cannot fuse it (a matmul's)
    input_bytes: int = 0               # bytes of the inputs its op read (a reduction's are 4x its own)
    users: list = field(default_factory=list)
    position: tuple = ()               # (op, output) in the layer's forward, or ("in", n) for its n-th input
    forced: bool = False               # a selective policy recomputes it (PREFER_RECOMPUTE): never saved


def partition_saved(values: dict[int, Value]) -> set[int]:
    """The values the partitioner saves for backward (a minimum cut; see the module docstring)."""
    import networkx as nx

    g = nx.DiGraph()
    inf = float("inf")
    wanted, stack = set(), [k for k, v in values.items() if v.needed]     # what backward reads and its sources
    while stack:
        k = stack.pop()
        if k not in wanted and k in values:
            wanted.add(k)
            stack.extend(values[k].inputs)
    for key, v in values.items():
        # the partitioner's must_recompute (a selective policy's): computed in backward where backward needs it
        forced = v.forced and not v.primal and key in wanted
        if forced:
            g.add_edge(f"{key}_in", "sink", capacity=inf)
        elif v.needed:
            g.add_edge(f"{key}_out", "sink", capacity=inf)
        # a matmul's input is read whole by its weight gradient's matmul: "materialized in backward"
        banned = not forced and (v.primal or not v.recomputable or (v.needed and v.read_by_unfusible)
                                 or v.nbytes * 4 < v.input_bytes)
        if banned:
            g.add_edge("source", f"{key}_in", capacity=inf)
        materialized = v.primal or v.read_by_unfusible or not v.users
        weight = 0 if v.free else (v.nbytes if materialized else 2 * v.nbytes)
        g.add_edge(f"{key}_in", f"{key}_out", capacity=weight)
        for i in v.inputs:
            if i in values:
                g.add_edge(f"{i}_out", f"{key}_in", capacity=inf)
    if "sink" not in g:
        return set()
    g.add_node("source")
    _, (reachable, _) = nx.minimum_cut(g, "source", "sink")
    return {k for k in values if f"{k}_in" in reachable and f"{k}_out" not in reachable}
