"""The parameters cast to the compute precision in one op, and their gradients back to the
masters' precision in one (docs/gpu.md "Ops of the eager step"). Cast leaf by leaf, an eager
16-bit step launched one copy kernel per parameter leaf each way (the H200 trace's 282
``direct_copy`` kernels of a 147-leaf model); here one foreach copy writes every cast (one
multi-tensor kernel on a GPU). The numbers are a cast's either way."""
from __future__ import annotations

from typing import Sequence

import torch

from functional_pp._torch import is_tracing


def _cast_by_one_copy(xs: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``xs`` cast to ``dtype`` by one foreach copy, each into a buffer of its own (of its
    strides, as ``x.to`` makes; not views of one buffer: a parameter is known by its block,
    ``parallel/fsdp/param_uses.py``)."""
    outs = [torch.empty_like(x, dtype=dtype) for x in xs]
    torch._foreach_copy_(outs, list(xs))
    return outs


def _one_copy(t, tracing: bool) -> bool:
    """Whether ``t`` is cast by the foreach copy: ``tracing`` (:func:`is_tracing`, asked once
    per cast, not per leaf), any; eager, a plain tensor (a gradient placeholder still in flight
    or another subclass is cast on its own)."""
    return tracing or type(t) is torch.Tensor


class _CastAll(torch.autograd.Function):
    """Every input cast to ``dtype`` in one op; in backward, every gradient cast back to its
    input's dtype in one op (a gradient still in flight, a bucket's or an FSDP unit's
    placeholder, is cast on its own: it stays pending until the optimizer)."""

    # its outputs are casts of parameters: a data-parallel gradient of one goes to the gradient
    # buckets as a cast's by ``x.to`` does (parallel/transposes.py)
    casts_leaves = True

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *xs: torch.Tensor):
        ctx.set_materialize_grads(False)       # an unused parameter keeps no gradient (autograd.grad says so)
        ctx.dtypes = [x.dtype for x in xs]
        return tuple(_cast_by_one_copy(xs, dtype))

    @staticmethod
    def backward(ctx, *gs):
        tracing = is_tracing()
        plain = [i for i, g in enumerate(gs) if g is not None and _one_copy(g, tracing)]
        out: list = [None if g is None else g if i in plain else g.to(d)
                     for i, (g, d) in enumerate(zip(gs, ctx.dtypes))]
        for dtype in {ctx.dtypes[i] for i in plain}:
            same = [i for i in plain if ctx.dtypes[i] == dtype]
            for i, g in zip(same, _cast_by_one_copy([gs[i] for i in same], dtype)):
                out[i] = g
        return (None, *out)


def cast_floating(leaves: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``leaves`` with every floating-point one of another dtype cast to ``dtype``, as
    ``x.to(dtype)`` would (differentiable: the gradient comes back in the leaf's dtype): one
    foreach copy for the leaves that need gradients and one for the others (per device). Traced,
    inductor fuses the copy into the kernels that first read the casts (the norms'), and the
    gradients' into the update's."""
    leaves, tracing = list(leaves), is_tracing()
    todo = [i for i, x in enumerate(leaves) if x.is_floating_point() and x.dtype != dtype]
    for i in [i for i in todo if not _one_copy(leaves[i], tracing)]:
        leaves[i] = leaves[i].to(dtype)
    todo = [i for i in todo if _one_copy(leaves[i], tracing)]
    if len(todo) < 2:
        for i in todo:
            leaves[i] = leaves[i].to(dtype)
        return leaves
    groups: dict[tuple, list[int]] = {}
    for i in todo:
        groups.setdefault((leaves[i].device, leaves[i].requires_grad), []).append(i)
    for (_, grad), idx in groups.items():
        xs = [leaves[i] for i in idx]
        if grad and torch.is_grad_enabled():
            cast = _CastAll.apply(dtype, *xs)
        else:
            with torch.no_grad():
                cast = _cast_by_one_copy(xs, dtype)
        for i, y in zip(idx, cast):
            leaves[i] = y
    return leaves
