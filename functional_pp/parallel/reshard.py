"""Moving a named value between layouts (docs/layouts.md): :func:`relayout` all-gathers what
is split but should not be and slices what should be split; :func:`named` takes this device's
block of a full tensor. Layout only: the FSDP bookkeeping of a gathered parameter (its shard
kept for a re-gather in backward) is added by the ops' relayout, functional_pp/parallel/fsdp/regather.py."""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from functional_pp.core.layout import Layout
from functional_pp.core.order import from_balanced, to_balanced
from functional_pp.parallel import collectives as C
from functional_pp.parallel.fsdp.role import after_reshard, keeps_relayout
from functional_pp.parallel.named import NO_AXES, Named, make_named, memo_table, env, settle, target_layout


class Reshard(NamedTuple):
    """What :func:`reshard` did: ``value`` in the target layout (layout only: no origin),
    ``gathers`` the ``(shard, axes, dim, order)`` of each all-gather it made, in order, and
    whether it ``sliced`` a dimension."""
    value: Named
    gathers: tuple
    sliced: bool


Gather = Callable[[torch.Tensor, tuple, int], torch.Tensor]


def all_gather_tiled(data: torch.Tensor, axes: tuple, dim: int) -> torch.Tensor:
    """The default :data:`Gather`: ``data`` all-gathered over ``axes`` along ``dim``."""
    return C.all_gather(data, axes, axis=dim, tiled=True)


def relayout(x: Named, target: Layout, op: str = "relayout") -> Named:
    """Change the splits of ``x`` to ``target`` (one entry per dimension): all-gather what is
    split but should not be (backward: reduce-scatter), slice what should be split (free).
    ``op`` names the operation in errors. Layout only: the ops relayout through
    ``functional_pp.parallel.fsdp.regather.relayout``, which adds the FSDP bookkeeping (docs/layouts.md)."""
    return relayout_with(x, target, lambda x, target: reshard(x, target, op))


def relayout_with(x: Named, target: Layout, change: Callable[[Named, Layout], Reshard]) -> Named:
    """The frame of a relayout: settle ``x`` towards ``target``; when the layouts differ,
    ``change(x, target)`` builds the result, memoised per value (one value used by several ops
    is converted once), except a gathered parameter that is not tied: a cached gathered weight
    would live as long as its shard (docs/named_value.md)."""
    x = settle(x, target)
    if x._split == target:
        return x
    target = tuple(tuple(t) for t in target)
    if x._split == target:
        return x
    key = ("relayout", target)
    memo = memo_table(x)
    if key in memo:
        return memo[key]
    out, gathers, _ = change(x, target)
    if keeps_relayout(x.role, bool(gathers)):
        memo[key] = out
    return out


def reshard(x: Named, target: Layout, op: str = "relayout", gather: Gather = all_gather_tiled) -> Reshard:
    """Move the settled ``x`` to the layout ``target`` (not memoised): all-gather through
    ``gather(data, axes, dim)`` the axes beyond the common prefix of each dimension, then slice
    what ``target`` splits further. ``op`` names the operation in errors."""
    data, split, vary = x._data, list(x._split), set(x._vary)
    mesh, rules = env()
    gathers = []
    # gather the axes beyond the common prefix (inner axes first: one collective per dim);
    # a load-balanced dimension gathered whole is put back in natural order (docs/layouts.md)
    for d, (have, want) in enumerate(zip(x._split, target)):
        k = 0
        while k < min(len(have), len(want)) and have[k] == want[k]:
            k += 1
        extra = have[k:]
        if extra:
            shard = data
            data = gather(data, extra, d)
            split[d] = have[:k]
            order = 1                       # the recipe replays the reorder (docs/layouts.md)
            if k == 0 and rules.splits_balanced(x._dims[d], have):
                order = mesh.shape[have[0]]
                data = from_balanced(data, d, order, x._dims[d])
            gathers.append((shard, extra, d, order))
    sliced = False
    for d, want in enumerate(target):
        extra = want[len(split[d]):]
        if not extra:
            continue
        sliced = True
        used_elsewhere = [a for dd, s in enumerate(split) if dd != d for a in s if a in extra]
        if used_elsewhere:
            raise ValueError(f"{op}: mesh axis {used_elsewhere[0]!r} cannot split dimension "
                             f"{x._dims[d]!r}; it already splits another dimension of {x._dims}")
        if not split[d] and rules.splits_balanced(x._dims[d], want):
            data = to_balanced(data, d, mesh.shape[extra[0]], x._dims[d])
        for a in extra:
            n = mesh.shape[a]
            if data.shape[d] % n:
                raise ValueError(f"dimension {x._dims[d]!r} of local size {data.shape[d]} cannot be split "
                                 f"over mesh axis {a!r} of size {n}")
            if a in vary:
                data = C.slice_varying(data, a, d)
            else:
                data = C.split_invariant(data, a, d)
                vary.add(a)
            split[d] = split[d] + (a,)
    out = make_named(data, x._dims, tuple(split), frozenset(vary), NO_AXES, x._sizes, after_reshard(x.role))
    return Reshard(out, tuple(gathers), sliced)


def named(data: torch.Tensor, dims: Sequence[str] | str) -> Named:
    """Wrap a FULL (replicated, invariant) tensor and take this device's block per the rules."""
    if isinstance(dims, str):
        dims = dims.split()
    x = Named(data, dims)
    return relayout(x, target_layout(x._dims, data.shape))

