"""Rows of one named array written into another at given positions (a masked scatter)."""
from __future__ import annotations

import torch

from functional_pp.ops.attention import positions
from functional_pp.ops.einsum import einsum
from functional_pp.ops.elementwise import broadcast, where
from functional_pp.parallel.named import Named, require_named


def masked_scatter(x: Named, source: Named, index: Named, along: str) -> Named:
    """``x`` where ``index`` < 0, else entry ``index`` of ``source`` along its dimension ``along``:
    torch's ``x.masked_scatter(index >= 0, source)`` with each position's source row given
    explicitly (the k-th masked position of a row takes ``index`` k), so any split of ``x``'s
    dimensions keeps its meaning (a vision-language model's image features written at its image
    tokens). ``index`` (integer) has ``x``'s dimensions less those it shares with ``source``
    beside ``along`` (e.g. ``batch seq`` for ``x`` batch seq hidden and ``source`` batch merged
    hidden); the rows are picked by a one-hot contraction, exact in every dtype, and the
    gradient flows to ``x`` where kept and to ``source``'s picked rows."""
    require_named("masked_scatter", x=x, source=source, index=index)
    source._check_dim(along, "masked_scatter")
    if index.data.dtype.is_floating_point or index.data.dtype == torch.bool:
        raise TypeError(f"masked_scatter: index must be an integer tensor (-1 where x is kept), got {index.data.dtype}")
    if along in x.dims or along in index.dims:
        raise ValueError(f"masked_scatter: {along!r} is source's dimension to pick from; x {x.dims} and index "
                         f"{index.dims} must not have it")
    rows = positions(along, source.size(along), device=index.data.device)
    dtype = source.data.dtype
    one_hot = broadcast(lambda i, r: (i == r).to(dtype), [index, rows], "masked_scatter one-hot")
    spec = f"{' '.join(one_hot.dims)}, {' '.join(source.dims)} -> {' '.join(x.dims)}"
    picked = einsum(spec, one_hot, source)
    return where(index.map(lambda t: t >= 0), picked, x)
