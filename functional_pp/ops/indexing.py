"""Indexing along a named dimension: take one entry, slice a range, unbind, concatenate.

A split dimension is gathered whole first (in its order, docs/layouts.md), then the result is
laid out by the rules again; an unsplit dimension costs nothing."""
from __future__ import annotations

from typing import Sequence

import torch

from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.named import Named, pvary, settle, target_layout, varying_after


def _whole_along(x: Named, dim: str, op: str) -> tuple[Named, int]:
    x = settle(x)
    x._check_dim(dim, op)
    i = x.dims.index(dim)
    if x.split[i]:
        x = relayout(x, tuple(() if j == i else s for j, s in enumerate(x.split)), op)
    return x, i


def _laid_out(data: torch.Tensor, dims: Sequence[str], split, vary, op: str) -> Named:
    y = Named(data, dims, split, vary)
    return relayout(y, target_layout(y.dims, list(y.shape.values()), name=op), op)


def take(x: Named, dim: str, index: int) -> Named:
    """Entry ``index`` of dimension ``dim`` (the dimension is removed)."""
    x, i = _whole_along(x, dim, f"take {dim}")
    n = x.data.shape[i]
    if not -n <= index < n:
        raise IndexError(f"take: index {index} is out of range for dimension {dim!r} of size {n}")
    keep = [j for j in range(len(x.dims)) if j != i]
    return _laid_out(x.data.select(i, index), [x.dims[j] for j in keep], [x.split[j] for j in keep],
                     x.vary, f"take {dim}")


def slice_dim(x: Named, dim: str, start: int, stop: int, into: str | None = None) -> Named:
    """Entries ``start:stop`` of ``dim``, as a dimension named ``into`` (default ``dim``)."""
    x, i = _whole_along(x, dim, f"slice {dim}")
    n = x.data.shape[i]
    if not 0 <= start < stop <= n:
        raise IndexError(f"slice_dim: {start}:{stop} is not a non-empty range of dimension {dim!r} "
                         f"of size {n}")
    dims = list(x.dims)
    dims[i] = into or dim
    if dims.count(dims[i]) > 1:
        raise ValueError(f"slice_dim: the result would name {dims[i]!r} twice in {tuple(dims)}")
    return _laid_out(x.data.narrow(i, start, stop - start), dims, x.split, x.vary, f"slice {dim}")


def unbind(x: Named, dim: str) -> list[Named]:
    """Every entry of ``dim`` (e.g. q, k and v of a fused projection): a list of named arrays."""
    x, _ = _whole_along(x, dim, f"unbind {dim}")
    return [take(x, dim, k) for k in range(x.size(dim))]


def concat(xs: Sequence[Named], dim: str, into: str | None = None) -> Named:
    """Concatenate along ``dim`` (named ``into`` in the result, default ``dim``); the other
    dimensions must agree in names and sizes."""
    xs = list(xs)
    if not xs or not all(isinstance(x, Named) for x in xs):
        raise TypeError("concat: give a non-empty list of named arrays")
    ready = [_whole_along(x, dim, f"concat {dim}")[0] for x in xs]
    others = sorted(d for d in ready[0].dims if d != dim)
    sizes0 = {d: n for d, n in ready[0].shape.items() if d != dim}
    for k, x in enumerate(ready[1:], 1):
        sizes = {d: n for d, n in x.shape.items() if d != dim}
        if sorted(sizes) != others or sizes != sizes0:
            raise ValueError(f"concat: operand {k} has dimensions {x.shape} but operand 0 has "
                             f"{ready[0].shape}; all must agree except along {dim!r}")
    # one layout for every operand: operand 0's (with dim whole), all varying alike
    order, t0 = ready[0].dims, ready[0].split
    aligned = []
    for x in ready:
        t = tuple(t0[order.index(d)] for d in x.dims)
        aligned.append((x, t))
    after = [varying_after(x, t) for x, t in aligned]
    union = set().union(*after)
    blocks = []
    for (x, t), a in zip(aligned, after):
        x = relayout(pvary(x, union - a), t, f"concat {dim}")
        blocks.append(x.data.permute([x.dims.index(d) for d in order]))
    i = order.index(dim)
    dims = list(order)
    dims[i] = into or dim
    return _laid_out(torch.cat(blocks, dim=i), dims, t0, union, f"concat {dim}")


def cumsum(x: Named, dim: str) -> Named:
    """Cumulative sum along ``dim`` in its natural order (a split dimension is gathered in
    its layout's order and the result split again)."""
    x, i = _whole_along(x, dim, f"cumsum {dim}")
    return _laid_out(torch.cumsum(x.data, dim=i), x.dims, x.split, x.vary, f"cumsum {dim}")
