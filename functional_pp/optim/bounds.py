"""Pre-update bounds (docs/optim.md "Bound before the update"): whether an optimizer's new
parameters are shown finite from one global norm, before the update is computed or written.

A step that writes its result into the state it was given (in place, or a compiled step with
donated state) cannot take a non-finite result back, so it writes only where the bound shows the
result finite and is "held" (writes nothing) elsewhere; the caller then makes the update in new
buffers. An optimizer offers its bound with :func:`functional_pp.optim.update_bound`."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from ..torch_private import is_tracing
from .base import PyTree, ScalarOrSchedule, tree_leaves
from .clipping import sq_sums

Reducer = Callable[[PyTree], torch.Tensor]   # per-leaf 0-dim sums -> their global total


class UpdateBound(NamedTuple):
    """A bound from ``n``, the global 2-norm of the gradients together with the tensors
    ``terms(state, params)`` names for each parameter leaf (e.g. the leaf and its moment):
    ``shows_finite(n, state, params)`` is a 0-dim bool, true only where the new parameters are
    certainly finite (NaN or inf ``n``: false)."""
    terms: Callable[[Any, Any], list[list[torch.Tensor]]]
    shows_finite: Callable[[torch.Tensor, Any, Any], torch.Tensor]


def grad_and_bound_norms(bound: UpdateBound, grads: list[torch.Tensor], state: Any, params: Any,
                         reducer: Reducer) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients' global norm (as ``optim.global_norm(grads, reducer)``) and the bound's ``n``.
    Traced, leaf by leaf: ``sum(g * g)`` next to ``sum(g * g + t * t + ...)``, two reductions
    reading one gradient side by side, which the compiler computes in one loop (it does not fuse
    reductions far apart in the graph; docs/compile.md "Update phase, fourth round")."""
    terms = bound.terms(state, params)
    if not is_tracing():
        grad_norm = torch.sqrt(reducer(sq_sums(grads)))
        return grad_norm, bound_norm(bound, state, params, grad_norm, reducer)
    g_sq, joint = [], []
    for g, ts in zip(grads, terms):
        g = _wide(g)
        g_sq.append(torch.sum(g * g))
        total = g * g
        for t in ts:
            t = _wide(t)
            total = total + t * t
        joint.append(torch.sum(total))
    return torch.sqrt(reducer(g_sq)), torch.sqrt(reducer(joint).to(torch.float64))


def bound_norm(bound: UpdateBound, state: Any, params: Any, grad_norm: torch.Tensor,
               reducer: Optional[Reducer]) -> torch.Tensor:
    """The bound's ``n`` (fp64) given the gradients' global norm: the foreach norms of its terms,
    completed by ``reducer`` (or added up), and ``grad_norm``."""
    reduce = reducer if reducer is not None else (lambda sq: torch.stack(tree_leaves(sq)).sum())
    terms = bound.terms(state, params)
    if not terms:
        return grad_norm.to(torch.float64)
    per_kind = [sq_sums([ts[k] for ts in terms]) for k in range(len(terms[0]))]
    joint = [sum(sums[1:], sums[0]) for sums in zip(*per_kind)]
    return torch.sqrt(reduce(joint).to(torch.float64) + grad_norm.to(torch.float64) ** 2)


def limit(leaves: list[torch.Tensor]) -> float:
    """The largest 2-norm a bound may show for new parameter leaves of these dtypes: a quarter of
    the square root of the smallest dtype's largest value (beyond it a leaf's 2-norm, the eager
    finiteness check, may overflow)."""
    return min(torch.finfo(p.dtype).max for p in leaves) ** 0.5 / 4


def adamw_bound(lr: ScalarOrSchedule, b1: float, eps: float, weight_decay: float) -> UpdateBound:
    """The bound of ``optim.adamw(lr, b1, ..., eps, weight_decay)`` (state: a chain ending in
    ``scale_by_adam``, ``add_decayed_weights``, ``scale_by_learning_rate``): every new parameter
    leaf has 2-norm at most ``|1 - lr wd| |p| + lr / (1 - b1^t) (|m| + |g|) / eps`` (the new first
    moment is a convex combination of the old one and the gradient, the denominator is at least
    ``eps``), at most ``(|1 - lr wd| + 2 lr / (1 - b1^t) / eps) n`` with ``n`` the global norm of
    the gradients, parameters and first moments. Clipping only shrinks the gradients. Loose by
    Adam's normalisation (up to about ``|g| / eps``), so it stays far below the limit in any usual
    training; a learning rate such as 1e12 crosses it."""

    def terms(state: tuple, params: PyTree) -> list[list[torch.Tensor]]:
        return [[p, m] for p, m in zip(tree_leaves(params), tree_leaves(state[-3].mu))]

    def shows_finite(n: torch.Tensor, state: tuple, params: PyTree) -> torch.Tensor:
        adam, schedule = state[-3], state[-1]     # chain: [clip], adam, decay, learning rate
        ps = tree_leaves(params)
        if not ps:
            return torch.ones((), dtype=torch.bool)
        f64 = torch.float64
        rate = lr(schedule.count) if callable(lr) else lr
        rate = torch.as_tensor(rate).to(f64) if isinstance(rate, torch.Tensor) else torch.tensor(rate, dtype=f64)
        bc1 = 1.0 - torch.pow(torch.tensor(b1, dtype=f64), (adam.count + 1).to(f64))
        shrink = torch.clamp((1.0 - rate * weight_decay).abs(), min=1.0)     # (masked leaves: no decay)
        return (shrink + 2.0 * rate / bc1 / eps) * n.to(f64) < limit(ps)

    return UpdateBound(terms, shows_finite)


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
