"""Pre-update bounds (docs/optim.md "Bound before the update"): whether an optimizer's new
parameters are shown finite from one global norm, before the update is computed or written.

A step that writes its result into the state it was given (in place, or a compiled step with
donated state) cannot take a non-finite result back, so it writes only where the bound shows the
result finite and is "held" (writes nothing) elsewhere; the caller then makes the update in new
buffers. An optimizer offers its bound with :func:`functional_pp.optim.update_bound`."""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..torch_private import is_tracing
from .base import PyTree, ScalarOrSchedule, tree_leaves
from .clipping import sq_sums

Reducer = Callable[[PyTree], torch.Tensor]   # per-leaf 0-dim sums -> their global total
# relative slack on the computed norm for the rounding of the few operations between it and the
# update (docs/optim.md "Bound before the update": a few hundred units in the last place of fp32)
ROUNDING_SLACK = 2.0 ** -16
# the largest lr * weight_decay whose decay factor (1 - lr wd) stays within [0, 1] through rounding
MAX_DECAY = 1.0 - 2.0 ** -10


class UpdateBound(NamedTuple):
    """A bound from ``n``, the global 2-norm of the gradients together with the tensors
    ``terms(state, params)`` names for each parameter leaf (e.g. the leaf's first moment):
    ``shows_finite(n, state, params)`` is a 0-dim bool, true only where the new parameters are
    certainly finite (NaN or inf ``n``: false). With ``needs_finite_params`` it holds only for
    finite parameters: the caller folds whether they are into ``n`` (inf where not), from a flag
    it knows (``params_finite``) or, without one, from a read of the parameters."""
    terms: Callable[[Any, Any], list[list[torch.Tensor]]]
    shows_finite: Callable[[torch.Tensor, Any, Any], torch.Tensor]
    needs_finite_params: bool = False


def params_finite(leaves: list[torch.Tensor]) -> torch.Tensor:
    """Whether every element of these (local) tensors is finite: a 0-dim bool from their extreme
    values (NaN or inf iff one is; no overflow, no host read; eager ``aminmax``, one pass without
    temporaries, where the foreach infinity-norm is 5x slower on the CPU)."""
    leaves = [x for x in leaves if x.numel()]       # (an empty leaf has no extreme value)
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    if is_tracing():
        peaks = [x.abs().amax() for x in leaves]
    else:
        peaks = [v for x in leaves for v in torch.aminmax(x)]
    return torch.stack([torch.isfinite(x) for x in peaks]).all()


def grad_and_bound_norms(bound: UpdateBound, grads: list[torch.Tensor], state: Any, params: Any,
                         reducer: Reducer, params_finite: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients' global norm (as ``optim.global_norm(grads, reducer)``) and the bound's ``n``
    (``params_finite``: the local parameters' flag where the bound needs it, else read here).
    Traced, leaf by leaf: ``sum(g * g)`` next to ``sum(g * g + t * t + ...)``, two reductions
    reading one gradient side by side, which the compiler computes in one loop (it does not fuse
    reductions far apart in the graph; docs/compile.md "Update phase, fourth round")."""
    terms = bound.terms(state, params)
    if not is_tracing():
        grad_norm = torch.sqrt(reducer(sq_sums(grads)))
        return grad_norm, bound_norm(bound, state, params, grad_norm, reducer, params_finite)
    g_sq, joint = [], []
    for g, ts in zip(grads, terms):
        g = _wide(g)
        g_sq.append(torch.sum(g * g))
        total = g * g
        for t in ts:
            t = _wide(t)
            total = total + t * t
        joint.append(torch.sum(total))
    joint = _unless_params_finite(bound, joint, params, params_finite)
    return torch.sqrt(reducer(g_sq)), torch.sqrt(reducer(joint).to(torch.float64))


def bound_norm(bound: UpdateBound, state: Any, params: Any, grad_norm: torch.Tensor,
               reducer: Optional[Reducer], params_finite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The bound's ``n`` (fp64) given the gradients' global norm: the foreach norms of its terms,
    completed by ``reducer`` (or added up), and ``grad_norm`` (inf where the bound needs finite
    parameters and ``params_finite``, or a read of them, says they are not)."""
    reduce = reducer if reducer is not None else (lambda sq: torch.stack(tree_leaves(sq)).sum())
    terms = bound.terms(state, params)
    if terms and terms[0]:
        per_kind = [sq_sums([ts[k] for ts in terms]) for k in range(len(terms[0]))]
        joint = [sum(sums[1:], sums[0]) for sums in zip(*per_kind)]
    else:
        joint = [torch.zeros((), dtype=grad_norm.dtype, device=grad_norm.device) for _ in tree_leaves(params)]
    joint = _unless_params_finite(bound, joint, params, params_finite)
    if not joint:
        return grad_norm.to(torch.float64)
    return torch.sqrt(reduce(joint).to(torch.float64) + grad_norm.to(torch.float64) ** 2)


def _unless_params_finite(bound: UpdateBound, joint: list[torch.Tensor], params: Any,
                          flag: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """Each leaf's partial sum plus inf where the (local) parameters are not finite: completed over
    the mesh like the sums, every device then sees inf (docs/optim.md "Bound before the update")."""
    if not bound.needs_finite_params or not joint:
        return joint
    flag = params_finite(tree_leaves(params)) if flag is None else flag
    penalty = torch.where(flag.to(joint[0].device), 0.0, math.inf).to(joint[0].dtype)
    return [s + penalty for s in joint]


def limit(leaves: list[torch.Tensor]) -> float:
    """The largest 2-norm a bound may show for new parameter leaves of these dtypes: a quarter of
    the square root of the smallest dtype's largest value (beyond it a leaf's 2-norm, the eager
    finiteness check, may overflow)."""
    return min(torch.finfo(p.dtype).max for p in leaves) ** 0.5 / 4


def margin(dtypes) -> float:
    """A quarter of half the spacing of the floats at the largest finite value of the narrowest of
    these dtypes (fp32: 2**101): a finite value of that dtype plus a term below this rounds to a
    finite value, even after a second rounding from fp32 to a 16-bit dtype."""
    def half_ulp_at_max(dtype: torch.dtype) -> float:
        info = torch.finfo(dtype)
        return math.ldexp(info.eps, math.frexp(info.max)[1] - 2)
    return min(half_ulp_at_max(d) for d in dtypes) / 4


def adamw_bound(lr: ScalarOrSchedule, b1: float, eps: float, weight_decay: float) -> UpdateBound:
    """The bound of ``optim.adamw(lr, b1, ..., eps, weight_decay)`` (state: a chain ending in
    ``scale_by_adam``, ``add_decayed_weights``, ``scale_by_learning_rate``).

    ``weight_decay <= 1``: elementwise, the new parameter is ``p (1 - lr wd) - lr a`` with the
    Adam direction ``|a| <= max(|m|, |g|) / ((1 - b1^t) eps)`` (the new first moment is a convex
    combination of the old one and the gradient, the denominator is at least ``eps``) and
    ``max(|m|, |g|) <= n``, the global norm of the gradients and first moments. For finite
    parameters (``needs_finite_params``) and ``lr wd <= MAX_DECAY``, ``|p (1 - lr wd)| <= |p|``,
    so the result is finite when ``max(1, lr) a`` stays below :func:`margin` of the dtypes:
    no read of the parameters. Larger decay: the old joint bound, every new parameter leaf has
    2-norm at most ``(|1 - lr wd| + 2 lr / (1 - b1^t) / eps) n`` with ``n`` the global norm of the
    gradients, parameters and first moments, below :func:`limit`. Clipping only shrinks the
    gradients (docs/optim.md "Bound before the update" gives the rounding argument)."""
    b1 = max(b1, float(torch.tensor(b1, dtype=torch.float32)))    # as fp32 kernels round it (near 1: up)
    if weight_decay <= 1.0:
        return UpdateBound(_first_moments, _decay_bounded(lr, b1, eps, weight_decay), needs_finite_params=True)

    def terms(state: tuple, params: PyTree) -> list[list[torch.Tensor]]:
        return [[p, m] for p, m in zip(tree_leaves(params), tree_leaves(state[-3].mu))]

    def shows_finite(n: torch.Tensor, state: tuple, params: PyTree) -> torch.Tensor:
        ps = tree_leaves(params)
        if not ps:
            return torch.ones((), dtype=torch.bool)
        rate, bc1 = _rate_and_bias_correction(lr, b1, state)
        shrink = torch.clamp((1.0 - rate * weight_decay).abs(), min=1.0)     # (masked leaves: no decay)
        return (bc1 > 0) & ((shrink + 2.0 * rate.abs() / bc1 / eps) * n.to(torch.float64) < limit(ps))

    return UpdateBound(terms, shows_finite)


def _first_moments(state: tuple, params: PyTree) -> list[list[torch.Tensor]]:
    return [[m] for m in tree_leaves(state[-3].mu)]


def _decay_bounded(lr: ScalarOrSchedule, b1: float, eps: float, weight_decay: float) -> Callable:
    def shows_finite(n: torch.Tensor, state: tuple, params: PyTree) -> torch.Tensor:
        ps = tree_leaves(params)
        if not ps:
            return torch.ones((), dtype=torch.bool)
        rate, bc1 = _rate_and_bias_correction(lr, b1, state)
        step = n.to(torch.float64) * (1.0 + ROUNDING_SLACK) / (bc1 * eps)   # bounds every |a|
        step = step * max(1.0, eps)      # (and the fused kernel's lr / bc1 * m' before it divides)
        room = margin([p.dtype for p in ps] + [m.dtype for m in tree_leaves(state[-3].mu)])
        return ((bc1 > 0) & (rate >= 0) & (rate * weight_decay <= MAX_DECAY)
                & (step * torch.clamp(rate, min=1.0) < room))

    return shows_finite


def _rate_and_bias_correction(lr: ScalarOrSchedule, b1: float, state: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's learning rate (fp64) and a lower bound of ``1 - b1^t`` as any of the kernels
    computes it (``b1``: the larger of it and its fp32 rounding; ``b1`` near 1 gives 0 in fp32)."""
    adam, schedule = state[-3], state[-1]     # chain: [clip], adam, decay, learning rate
    f64 = torch.float64
    rate = lr(schedule.count) if callable(lr) else lr
    rate = torch.as_tensor(rate).to(f64) if isinstance(rate, torch.Tensor) else torch.tensor(rate, dtype=f64)
    step = adam.count + 1
    t = torch.minimum(step.to(f64), step.to(torch.float32).to(f64))     # (fp32 rounds beyond 2**24)
    return rate, 1.0 - torch.pow(torch.tensor(b1, dtype=f64), t) - 2.0 ** -21    # (a few ulps of pow)


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
