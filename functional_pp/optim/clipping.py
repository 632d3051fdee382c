"""The global gradient norm and clipping by it.

Sharded gradients need their per-leaf sums of squares completed across devices: the caller
passes how, as ``reducer`` / the ``norm_reducer`` extra argument of ``update`` (the training
step gives one that all-reduces over the mesh axes that split each leaf; docs/optim.md)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from functional_pp._torch import is_tracing
from functional_pp.optim.base import (FRESH, EmptyState, GradientTransformation, PyTree, _scale_leaves, check_number,
                                      dtype_groups, state_dtype, transform, tree_flatten, tree_leaves, tree_unflatten)

NormReducer = Callable[[PyTree], torch.Tensor]
_WIDE = (torch.float32, torch.float64)     # dtypes that are their own state dtype


def global_norm(tree: PyTree, reducer: Optional[NormReducer] = None) -> torch.Tensor:
    """``sqrt(sum of squares of all leaves)`` as a 0-dim tensor (>= fp32).

    ``reducer(sq_sums)`` receives a tree (the structure of ``tree``) of 0-dim local sums of
    squares and returns the 0-dim global total (e.g. an all-reduce over the devices that
    split each leaf); without one, the local sums are added."""
    leaves, spec = tree_flatten(tree)
    sq = tree_unflatten(spec, sq_sums(leaves))
    if reducer is not None:
        return torch.sqrt(reducer(sq))
    leaves = tree_leaves(sq)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    dtype = leaves[0].dtype
    for t in leaves[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.sqrt(torch.stack([t.to(dtype) for t in leaves]).sum())


def sq_sums(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per leaf, the 0-dim sum of its squares in the state dtype (>= fp32). Eager: one
    ``torch._foreach_norm`` per (device, dtype) group, squared (one read of each leaf, no
    temporaries; may differ from ``sum(x * x)`` in the last bits). Traced: ``sum(x * x)``,
    which the compiler fuses into one reduction."""
    if is_tracing() or not leaves:
        # no dtype query for fp32/fp64 leaves
        wide = [x if x.dtype in _WIDE else x.to(state_dtype(x.dtype)) for x in leaves]
        return [torch.sum(x * x) for x in wide]
    out: list = [None] * len(leaves)
    for group in dtype_groups(leaves):
        xs = [leaves[i] for i in group]
        dtype = state_dtype(xs[0].dtype)
        norms = torch.stack(torch._foreach_norm(xs, 2) if xs[0].dtype == dtype
                            else torch._foreach_norm(xs, 2, dtype=dtype))
        for i, s in zip(group, (norms * norms).unbind()):
            out[i] = s
    return out


def clip_by_global_norm(max_norm: float, reducer: Optional[NormReducer] = None) -> GradientTransformation:
    """Scale updates by ``min(1, max_norm / (global_norm + 1e-6))`` (the formula of
    ``torch.nn.utils.clip_grad_norm_``). The norm uses ``reducer``, or the ``norm_reducer``
    extra argument of ``update`` when given (see :func:`global_norm`). A ``grad_norm`` extra
    argument (the global norm of the updates as given, which the training step has already
    computed) is used instead of computing it again."""
    max_norm = check_number("clip_by_global_norm", "max_norm", max_norm, low=0.0, low_open=True,
                            hint=" (the largest gradient norm kept, e.g. 1.0)")

    def update(updates: PyTree, state: EmptyState, params: PyTree = None, *, donate_updates: bool = False,
               norm_reducer: Optional[NormReducer] = None, grad_norm: Optional[torch.Tensor] = None,
               **extra: Any):
        norm = (grad_norm if grad_norm is not None
                else global_norm(updates, norm_reducer if norm_reducer is not None else reducer))
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return _scale_leaves(updates, coef, donate_updates), state

    return transform(lambda params: EmptyState(), update, FRESH)
