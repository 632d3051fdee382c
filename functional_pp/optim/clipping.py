"""The global gradient norm and clipping by it.

Sharded gradients need their per-leaf sums of squares completed across devices: the caller
passes how, as ``reducer`` / the ``norm_reducer`` extra argument of ``update`` (the training
step gives one that all-reduces over the mesh axes that split each leaf; docs/optim.md)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import optree
import torch

from .base import (FRESH, EmptyState, GradientTransformation, PyTree, _scale_leaves, check_number, state_dtype,
                   tree_flatten, tree_leaves, transform)

NormReducer = Callable[[PyTree], torch.Tensor]
_WIDE = (torch.float32, torch.float64)     # dtypes that are their own state dtype


def global_norm(tree: PyTree, reducer: Optional[NormReducer] = None) -> torch.Tensor:
    """``sqrt(sum of squares of all leaves)`` as a 0-dim tensor (>= fp32).

    ``reducer(sq_sums)`` receives a tree (the structure of ``tree``) of 0-dim local sums of
    squares and returns the 0-dim global total (e.g. an all-reduce over the devices that
    split each leaf); without one, the local sums are added."""
    leaves, spec = tree_flatten(tree)
    # per leaf sum(x * x) in the state dtype (>= fp32); no dtype query for fp32/fp64 leaves
    wide = [x if x.dtype in _WIDE else x.to(state_dtype(x.dtype)) for x in leaves]
    sq = optree.tree_unflatten(spec, [torch.sum(x * x) for x in wide])
    if reducer is not None:
        return torch.sqrt(reducer(sq))
    leaves = tree_leaves(sq)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    dtype = leaves[0].dtype
    for t in leaves[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.sqrt(torch.stack([t.to(dtype) for t in leaves]).sum())


def clip_by_global_norm(max_norm: float, reducer: Optional[NormReducer] = None) -> GradientTransformation:
    """Scale updates by ``min(1, max_norm / (global_norm + 1e-6))`` (the formula of
    ``torch.nn.utils.clip_grad_norm_``). The norm uses ``reducer``, or the ``norm_reducer``
    extra argument of ``update`` when given (see :func:`global_norm`)."""
    max_norm = check_number("clip_by_global_norm", "max_norm", max_norm, low=0.0, low_open=True,
                            hint=" (the largest gradient norm kept, e.g. 1.0)")

    def update(updates: PyTree, state: EmptyState, params: PyTree = None, *, donate_updates: bool = False,
               norm_reducer: Optional[NormReducer] = None, **extra: Any):
        norm = global_norm(updates, norm_reducer if norm_reducer is not None else reducer)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return _scale_leaves(updates, coef, donate_updates), state

    return transform(lambda params: EmptyState(), update, FRESH)
