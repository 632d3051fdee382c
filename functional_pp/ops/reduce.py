"""Reductions over named dimensions. A sum over a split dimension leaves a pending sum that
the next consumer completes (psum, or psum_scatter where it wants the axis split)."""
from __future__ import annotations

from typing import Sequence

import torch

from functional_pp.parallel import collectives as C
from functional_pp.parallel.named import Named, make_named, env, require_named, settle


def _dims(x: Named, dims, op: str) -> tuple[str, ...]:
    require_named(op, x=x)
    dims = (dims,) if isinstance(dims, str) else tuple(x.dims if dims is None else dims)
    for d in dims:
        x._check_dim(d, op)
    return dims


def _reduced(x: Named, dims, data: torch.Tensor, partial=(), settled=()) -> Named:
    """The result of reducing ``dims`` of ``x``: pending sums over ``partial`` added, the axes
    ``settled`` (already reduced over, e.g. by pmax) no longer varying."""
    keep = [i for i, d in enumerate(x.dims) if d not in dims]
    sizes = None if x._sizes is None else tuple(x._sizes[i] for i in keep)
    vary = x.vary.difference(settled) if settled else x.vary
    return make_named(data, tuple(x.dims[i] for i in keep), tuple(x.split[i] for i in keep), vary.union(partial),
                      x.partial.union(partial) if partial else x.partial, sizes)


def _split_axes(x: Named, dims) -> tuple[str, ...]:
    mesh = env()[0]
    axes = {a for d in dims for a in x.split[x.dims.index(d)]}
    return tuple(a for a in mesh.axis_names if a in axes)


def sum(x: Named, dims: str | Sequence[str] | None = None) -> Named:  # noqa: A001
    """Sum over ``dims`` (all when None)."""
    dims = _dims(x, dims, "sum")
    idx = [x.dims.index(d) for d in dims]
    data = x.data.sum(dim=idx) if idx else x.data
    return _reduced(x, dims, data, _split_axes(x, dims))


def mean(x: Named, dims: str | Sequence[str] | None = None) -> Named:
    """Mean over ``dims`` (global sizes)."""
    dims = _dims(x, dims, "mean")
    n = 1
    for d in dims:
        n *= x.size(d)
    return sum(x, dims) / n


def max(x: Named, dims: str | Sequence[str] | None = None) -> Named:  # noqa: A001
    """Maximum over ``dims`` (pmax across the axes splitting them). Its gradient is split
    equally among all the entries equal to the maximum, on every device (torch's ``amax``
    rule over the global dimension), so any layout gives one device's gradient, ties too."""
    dims = _dims(x, dims, "max")
    x = settle(x)
    idx = [x.dims.index(d) for d in dims]
    axes = _split_axes(x, dims)
    data = C.max_over(x.data, idx, axes or None) if idx else x.data
    return _reduced(x, dims, data, settled=axes)


def min(x: Named, dims: str | Sequence[str] | None = None) -> Named:  # noqa: A001
    """Minimum over ``dims`` (ties as :func:`max`)."""
    return -max(-x, dims)


def logsumexp(x: Named, dims: str | Sequence[str]) -> Named:
    """log(sum(exp(x))) over ``dims``, stable and exact across splits."""
    dims = _dims(x, dims, "logsumexp")
    x = settle(x)
    idx = [x.dims.index(d) for d in dims]
    axes = _split_axes(x, dims)
    if not axes:                      # nothing split: torch's fused kernel
        return _reduced(x, dims, torch.logsumexp(x.data, dim=idx))
    m = x.data.detach().amax(dim=idx, keepdim=True)
    if axes:
        m = C.raw_all_reduce(m, axes, "max")
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(x.data - m).sum(dim=idx)
    if axes:
        s = C.psum(s, axes)
    data = torch.log(s) + m.squeeze(idx) if idx else torch.log(s) + m
    return _reduced(x, dims, data, settled=axes)


def softmax(x: Named, dim: str) -> Named:
    """Softmax over ``dim``."""
    from functional_pp.ops.elementwise import exp
    return exp(x - logsumexp(x, dim))
