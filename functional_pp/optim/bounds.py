"""Pre-update bounds (docs/optim.md "Bound before the update"): whether an optimizer's new
parameters are shown finite from one global norm, before the update is computed or written.

A step that writes its result into the state it was given (in place, or a compiled step with
donated state) cannot take a non-finite result back, so it writes only where the bound shows the
result finite and is "held" (writes nothing) elsewhere; the caller then makes the update in new
buffers. An optimizer offers its bound with :func:`functional_pp.optim.update_bound`.

Mechanism: Optimizer update (the pre-update bound a donated step checks first).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from functional_pp._torch import is_tracing
from functional_pp.optim.adam import adamw_states, bias_correction, learning_rate
from functional_pp.optim.base import PyTree, ScalarOrSchedule, tree_leaves
from functional_pp.optim.clipping import sq_sums

Reducer = Callable[[PyTree], torch.Tensor]   # per-leaf 0-dim sums -> their global total
# relative slack on the computed norm for the rounding of the few operations between it and the
# update (docs/optim.md "Bound before the update": a few hundred units in the last place of fp32)
ROUNDING_SLACK = 2.0 ** -16
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# added to a leaf's gradient norm in a carried peak: above every |g| whose square underflows (below
# fp32's smallest normal, 2**-126), and far above any absolute rounding of subnormal values
SMALL_GRAD = 2.0 ** -62
# the largest lr * weight_decay whose decay factor (1 - lr wd) stays within [0, 1] through rounding
MAX_DECAY = 1.0 - 2.0 ** -10


class CarriedPeaks(NamedTuple):
    """Upper bounds of each leaf's largest magnitude of the bound's terms (one 0-dim tensor per
    parameter leaf, local to the device), carried from step to step instead of read
    (docs/optim.md "Peaks carried instead of read"). ``applies(state)``: whether the carried
    bound holds for this state (its dtypes; static); ``advance(peaks, grad_sq, state)``: the
    peaks after a written update whose gradients had the local per-leaf sums of squares
    ``grad_sq`` (before clipping)."""
    applies: Callable[[Any], bool]
    advance: Callable[[list[torch.Tensor], list[torch.Tensor], Any], list[torch.Tensor]]


class UpdateBound(NamedTuple):
    """A bound from ``n``, the global 2-norm of the gradients together with the tensors
    ``terms(state, params)`` names for each parameter leaf (e.g. the leaf's first moment):
    ``shows_finite(n, state, params)`` is a 0-dim bool, true only where the new parameters are
    certainly finite (NaN or inf ``n``: false; ``terms`` and ``shows_finite`` take
    ``leaves=(param leaves, first moment leaves)`` where the caller has flattened them already:
    no second flatten). With ``needs_finite_params`` it holds only for
    finite parameters: the caller folds whether they are into ``n`` (inf where not), from a flag
    it knows (``params_finite``) or, without one, from a read of the parameters. ``carried``:
    how a caller that keeps each leaf's peak of its terms (:func:`term_peaks`) carries it to
    the next step, so that ``n`` needs no read of the terms (:func:`carried_norms`)."""
    terms: Callable[[Any, Any], list[list[torch.Tensor]]]
    shows_finite: Callable[[torch.Tensor, Any, Any], torch.Tensor]
    needs_finite_params: bool = False
    carried: Optional[CarriedPeaks] = None


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
    reductions far apart in the graph; docs/compile.md "The update phase")."""
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


def term_peaks(bound: UpdateBound, state: Any, params: Any) -> list[torch.Tensor]:
    """Per parameter leaf, the largest magnitude of its bound terms on this device (0-dim, the
    terms' dtype; 0 for an empty leaf; NaN where a term holds one), read exactly: where a state
    enters that no step returned (docs/optim.md "Peaks carried instead of read"). Eager: each
    term's ``aminmax`` (one pass, no temporary; no host read)."""
    peaks = []
    for ts in bound.terms(state, params):
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in ts])
        values = [torch.zeros((), dtype=dtype, device=ts[0].device)]
        for t in ts:
            if not t.numel():
                continue
            if is_tracing():
                values.append(t.abs().amax().to(dtype))
            else:
                low, high = torch.aminmax(t)
                values.append(torch.maximum(-low, high).to(dtype))
        peaks.append(functools.reduce(torch.maximum, values))
    return peaks


def carried_norms(bound: UpdateBound, grads: list[torch.Tensor], peaks: list[torch.Tensor], params: Any,
                  reducer: Reducer, params_finite: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The gradients' global norm, the bound's ``n`` from the carried ``peaks`` of its terms (no
    read of the terms: ``sum(g * g) + peak ** 2`` per leaf, at least the leaf's share of the
    joint norm's square of :func:`grad_and_bound_norms` where each peak bounds its terms) and
    the local per-leaf sums of squares of the gradients (for ``bound.carried.advance``)."""
    g_sq = sq_sums(grads)
    joint = []
    for s, m in zip(g_sq, peaks):
        dtype = torch.promote_types(s.dtype, m.dtype)
        m = m.to(device=s.device, dtype=dtype)
        joint.append(s.to(dtype) + m * m)
    joint = _unless_params_finite(bound, joint, params, params_finite)
    grad_norm = torch.sqrt(reducer(g_sq))
    return grad_norm, torch.sqrt(reducer(joint).to(torch.float64)), g_sq


def bound_norm(bound: UpdateBound, state: Any, params: Any, grad_norm: torch.Tensor,
               reducer: Optional[Reducer], params_finite: Optional[torch.Tensor] = None,
               leaves: Optional[tuple] = None) -> torch.Tensor:
    """The bound's ``n`` (fp64) given the gradients' global norm: the foreach norms of its terms,
    completed by ``reducer`` (or added up), and ``grad_norm`` (inf where the bound needs finite
    parameters and ``params_finite``, or a read of them, says they are not). ``leaves``: the
    parameters' and first moments' leaves where the caller has them (``UpdateBound``)."""
    reduce = reducer if reducer is not None else (lambda sq: torch.stack(tree_leaves(sq)).sum())
    terms = bound.terms(state, params) if leaves is None else bound.terms(state, params, leaves=leaves)
    if terms and terms[0]:
        per_kind = [sq_sums([ts[k] for ts in terms]) for k in range(len(terms[0]))]
        joint = functools.reduce(_add_each, per_kind)
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
    return _add_each(joint, penalty)


def _add_each(xs: list[torch.Tensor], y) -> list[torch.Tensor]:
    """``[x + y_i for ...]`` (``y`` a list or one tensor): eager, one foreach op instead of one
    launch per leaf; traced, the elementwise form (the compiler fuses it; dynamo makes a
    0-dim tensor operand of a foreach op an unbacked scalar)."""
    ys = y if isinstance(y, list) else [y] * len(xs)     # (a list: a tensor operand would be read on the host)
    if is_tracing():
        return [a + b for a, b in zip(xs, ys)]
    return list(torch._foreach_add(xs, ys))


def limit(leaves: list[torch.Tensor]) -> float:
    """The largest 2-norm a bound may show for new parameter leaves of these dtypes: a quarter of
    the square root of the smallest dtype's largest value (beyond it a leaf's 2-norm, the eager
    finiteness check, may overflow)."""
    return _per_dtypes(_limit, frozenset(p.dtype for p in leaves))


def _limit(dtypes: frozenset) -> float:
    return min(torch.finfo(d).max for d in dtypes) ** 0.5 / 4


def margin(dtypes) -> float:
    """A quarter of half the spacing of the floats at the largest finite value of the narrowest of
    these dtypes (fp32: 2**101): a finite value of that dtype plus a term below this rounds to a
    finite value, even after a second rounding from fp32 to a 16-bit dtype. Derived once per set
    of dtypes (every eager step asks; ``torch.finfo`` per leaf cost about 0.1 ms a step)."""
    return _per_dtypes(_margin, frozenset(dtypes))


def _margin(dtypes: frozenset) -> float:
    def half_ulp_at_max(dtype: torch.dtype) -> float:
        info = torch.finfo(dtype)
        return math.ldexp(info.eps, math.frexp(info.max)[1] - 2)
    return min(half_ulp_at_max(d) for d in dtypes) / 4


_PER_DTYPES: dict = {}      # (function, dtypes) -> its value: eager steps derive it once


def _per_dtypes(fn: Callable[[frozenset], float], dtypes: frozenset) -> float:
    """``fn(dtypes)``, kept across eager calls (traced: computed, nothing kept across traces)."""
    if is_tracing():
        return fn(dtypes)
    value = _PER_DTYPES.get((fn, dtypes))
    if value is None:
        value = _PER_DTYPES[(fn, dtypes)] = fn(dtypes)
    return value


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
    carried = first_moment_peaks(b1)      # (the weights from b1 as given: 1 - b1 is the gradient's)
    b1 = max(b1, float(torch.tensor(b1, dtype=torch.float32)))    # as fp32 kernels round it (near 1: up)
    if weight_decay <= 1.0:
        return UpdateBound(_first_moments, _decay_bounded(lr, b1, eps, weight_decay), needs_finite_params=True,
                           carried=carried)

    def terms(state: tuple, params: PyTree, leaves: Optional[tuple] = None) -> list[list[torch.Tensor]]:
        ps, mus = (tree_leaves(params), tree_leaves(adamw_states(state)[0].mu)) if leaves is None else leaves
        return [[p, m] for p, m in zip(ps, mus)]

    def shows_finite(n: torch.Tensor, state: tuple, params: PyTree, leaves: Optional[tuple] = None) -> torch.Tensor:
        ps = tree_leaves(params) if leaves is None else leaves[0]
        if not ps:
            return torch.ones((), dtype=torch.bool)
        rate, bc1 = _rate_and_bias_correction(lr, b1, state)
        rate = torch.tensor(rate, dtype=torch.float64) if isinstance(rate, float) else rate
        shrink = torch.clamp((1.0 - rate * weight_decay).abs(), min=1.0)     # (masked leaves: no decay)
        return (bc1 > 0) & ((shrink + 2.0 * rate.abs() / bc1 / eps) * n.to(torch.float64) < limit(ps))

    return UpdateBound(terms, shows_finite)


def first_moment_peaks(b1: float) -> CarriedPeaks:
    """Adam's first moments' peaks carried from step to step (docs/optim.md "Peaks carried instead
    of read"): after a written update, ``M' = (A M + C G) (1 + s)`` per leaf, with ``M`` the
    peak before, ``G = sqrt(sum(g * g)) + 2**-62`` from the leaf's local gradient sum of squares
    before clipping (at least its largest ``|g|`` up to two roundings, also where ``g * g``
    underflows; clipping only shrinks ``g``), ``A`` and ``C`` the largest weights any kernel
    gives the old moment and the gradient (from ``b1``, ``1 - b1`` and their fp32 roundings; ``A``
    plus 4 units of rounding for the cancellation in ``m + w (g - m)``; both rounded up to the
    moment dtype) and ``s`` (:func:`peak_slack`) the relative rounding of the moment's update and
    of this recurrence. It applies where ``A (1 + s) <= (1 + A) / 2``: the peaks then stay within
    about twice the gradients' norm (no compounding of the slack)."""
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))     # noqa: E731 (fp32 rounding)
    a = max(b1, f32(b1), 1.0 - f32(1.0 - b1))
    c = max(1.0 - b1, f32(1.0 - b1), 1.0 - f32(b1), f32(1.0 - f32(b1)))
    # per moment dtype, computed here (not while traced): (A, C, 1 + s), or None where the slack
    # would compound (A (1 + s) > (1 + A) / 2: 16-bit moments, b1 within ~2**-18 of 1)
    weights = {}
    for d in FLOAT_DTYPES:
        u = _unit_roundoff(d)
        a_d, c_d, grow = _round_up(a + 4 * u, d), _round_up(c, d), 1.0 + peak_slack(d)
        weights[d] = (a_d, c_d, grow) if a_d * grow <= (1.0 + a_d) / 2 else None

    def applies(state: tuple) -> bool:
        return all(weights.get(m.dtype) is not None for m in tree_leaves(adamw_states(state)[0].mu))

    def advance(peaks: list[torch.Tensor], grad_sq: list[torch.Tensor], state: tuple) -> list[torch.Tensor]:
        out = []
        for m, s in zip(peaks, grad_sq):
            a_d, c_d, grow = weights[m.dtype]
            g = torch.sqrt(s).to(device=m.device, dtype=m.dtype) + SMALL_GRAD
            out.append((m * a_d + g * c_d) * grow)
        return out

    return CarriedPeaks(applies, advance)


def peak_slack(dtype: torch.dtype) -> float:
    """The relative slack ``s`` of a carried first-moment peak of ``dtype``: 32 units of rounding
    of it or of fp32 (the narrowest a gradient's sum of squares is computed in), whichever is
    larger; fp32: 2**-19."""
    return 32.0 * _unit_roundoff(dtype)


def _unit_roundoff(dtype: torch.dtype) -> float:
    """Half the spacing at 1 of ``dtype``, or of fp32 where that is larger."""
    return max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps) / 2


def _round_up(x: float, dtype: torch.dtype) -> float:
    """The least value of ``dtype`` at or above ``x`` (a Python float: exact in fp64 and wider)."""
    y = torch.tensor(x, dtype=torch.float64).to(dtype)
    if float(y) < x:
        y = torch.nextafter(y, torch.tensor(math.inf, dtype=dtype))
    return float(y)


def _first_moments(state: tuple, params: PyTree, leaves: Optional[tuple] = None) -> list[list[torch.Tensor]]:
    return [[m] for m in (tree_leaves(adamw_states(state)[0].mu) if leaves is None else leaves[1])]


def _decay_bounded(lr: ScalarOrSchedule, b1: float, eps: float, weight_decay: float) -> Callable:
    def shows_finite(n: torch.Tensor, state: tuple, params: PyTree, leaves: Optional[tuple] = None) -> torch.Tensor:
        ps, mus = (tree_leaves(params), None) if leaves is None else leaves
        if not ps:
            return torch.ones((), dtype=torch.bool)
        rate, bc1 = _rate_and_bias_correction(lr, b1, state)
        step = n.to(torch.float64) * (1.0 + ROUNDING_SLACK) / (bc1 * eps)   # bounds every |a|
        step = _times(step, max(1.0, eps))      # (and the fused kernel's lr / bc1 * m' before it divides)
        mus = tree_leaves(adamw_states(state)[0].mu) if mus is None else mus
        room = margin([p.dtype for p in ps] + [m.dtype for m in mus])
        if isinstance(rate, float):     # a constant rate: its checks on the host, in the same doubles
            fits = (bc1 > 0) & (_times(step, max(rate, 1.0)) < room)
            return fits if rate >= 0 and rate * weight_decay <= MAX_DECAY else fits & False
        return ((bc1 > 0) & (rate >= 0) & (rate * weight_decay <= MAX_DECAY)
                & (step * torch.clamp(rate, min=1.0) < room))

    return shows_finite


def _times(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor`` for a host constant; ``x`` itself for 1.0 (the same values: no op)."""
    return x if factor == 1.0 else x * factor


def _rate_and_bias_correction(lr: ScalarOrSchedule, b1: float,
                              state: tuple) -> tuple[torch.Tensor | float, torch.Tensor]:
    """This step's learning rate (fp64: a 0-dim tensor from a schedule or a tensor rate, a Python
    float for a constant one, no op) and a lower bound of ``1 - b1^t`` as any of the kernels
    computes it (``b1``: the larger of it and its fp32 rounding; ``b1`` near 1 gives 0 in fp32;
    ``torch.pow`` of the float ``b1`` and fp64 ``t``, the same doubles as of a tensor ``b1``)."""
    adam, schedule = adamw_states(state)
    f64 = torch.float64
    rate = learning_rate(lr, schedule)
    rate = torch.as_tensor(rate).to(f64) if isinstance(rate, torch.Tensor) else float(rate)
    step = adam.count + 1
    t = torch.minimum(step.to(f64), step.to(torch.float32).to(f64))     # (fp32 rounds beyond 2**24)
    return rate, bias_correction(float(b1), t) - 2.0 ** -21    # (a few ulps of pow)


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
