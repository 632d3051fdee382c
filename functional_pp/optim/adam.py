"""Adam's preconditioning, one implementation: a foreach kernel per stage over all leaves of a
(device, dtype), bias corrections computed once. ``adamw`` is ``scale_by_adam`` chained with
``add_decayed_weights`` and ``scale_by_learning_rate`` (:mod:`functional_pp.optim.optimizers`).

AdamW's pieces are defined here once: :func:`bias_correction`, :func:`adamw_states` (where the
moments and the schedule sit in the chain's state) and :func:`learning_rate` (this step's
rate). The in-place step (``optim/fused.py``: torch's fused kernel, the same formula, held
bitwise equal to this chain by tests/optim) and the pre-update bound (``optim/bounds.py``)
read them from here.

Mechanism: Optimizer update (AdamW's formula: the pure chain, bias corrections, learning rate).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from functional_pp._torch import is_tracing
from functional_pp.optim.base import (FRESH, GradientTransformation, PyTree, check_number, dtype_groups, new_count,
                                      transform, tree_flatten, tree_leaves, tree_map, tree_unflatten, zeros_state)


def bias_correction(b: float | torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``1 - b^count``: the bias correction of a moment with decay ``b`` after ``count`` steps
    (computed in ``count``'s dtype, or ``b``'s where it is a tensor)."""
    return 1.0 - torch.pow(b, count)


def adamw_states(state: tuple) -> tuple["ScaleByAdamState", Any]:
    """The Adam moments and the learning-rate schedule's state in the state of an AdamW chain
    (``[clip_by_global_norm], scale_by_adam, add_decayed_weights, scale_by_learning_rate``)."""
    return state[-3], state[-1]


def learning_rate(lr: Any, schedule: Any) -> Any:
    """This step's learning rate: ``lr`` at the schedule's count where it is a schedule, else
    ``lr`` itself."""
    return lr(schedule.count) if callable(lr) else lr


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`: ``count`` (0-dim int64, not param-like) and the first and
    second moments ``mu``/``nu`` (mirror the param tree)."""

    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    param_like_fields = ("mu", "nu")   # class attribute, not a field


def check_adam_hyperparameters(owner: str, b1: float, b2: float, eps: float) -> tuple[float, float, float]:
    """``(b1, b2, eps)`` as floats after checking ``0 <= b1, b2 < 1`` and ``eps > 0``."""
    b1 = check_number(owner, "b1", b1, low=0.0, high=1.0, high_open=True,
                      hint=" (the first-moment decay, e.g. 0.9)")
    b2 = check_number(owner, "b2", b2, low=0.0, high=1.0, high_open=True,
                      hint=" (the second-moment decay, e.g. 0.95 or 0.999)")
    eps = check_number(owner, "eps", eps, low=0.0, low_open=True, hint=" (added to the denominator, e.g. 1e-8)")
    return b1, b2, eps


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam preconditioning ``mu_hat / (sqrt(nu_hat) + eps)`` with bias correction, as
    ``torch.optim.Adam(W)`` (``eps`` after the square root). Moments are >= fp32 and mirror the
    param tree; updates come out in the moment dtype. With donated updates (the caller's
    gradients) the result is written into them: no tensor beyond the two new moments."""
    b1, b2, eps = check_adam_hyperparameters("scale_by_adam", b1, b2, eps)

    def init(params: PyTree) -> ScaleByAdamState:
        return ScaleByAdamState(count=new_count(params), mu=tree_map(zeros_state, params),
                                nu=tree_map(zeros_state, params))

    def update(updates: PyTree, state: ScaleByAdamState, params: PyTree = None, *, donate_updates: bool = False,
               **extra: Any):
        count = state.count + 1
        mu_leaves, spec = tree_flatten(state.mu)
        nu_leaves = tree_leaves(state.nu)
        g_leaves = tree_leaves(updates)
        if len(g_leaves) != len(mu_leaves):
            raise ValueError(f"scale_by_adam: {len(g_leaves)} updates for a state of {len(mu_leaves)} parameters; "
                             f"was the state made by init() of the same parameter tree?")
        in_place = donate_updates and not is_tracing()   # the compiler plans buffers itself
        mu, nu, out = list(mu_leaves), list(nu_leaves), list(g_leaves)
        for group in dtype_groups(mu_leaves):
            m_old, v_old = [mu_leaves[i] for i in group], [nu_leaves[i] for i in group]
            grads = [g_leaves[i].to(m_old[0].dtype) for i in group]
            c = count.to(device=m_old[0].device, dtype=m_old[0].dtype)
            bc1 = bias_correction(b1, c)
            bc2_sqrt = torch.sqrt(bias_correction(b2, c))
            m_new = torch._foreach_lerp(m_old, grads, 1.0 - b1)
            v_new = torch._foreach_mul(v_old, b2)
            torch._foreach_addcmul_(v_new, grads, grads, value=1.0 - b2)
            if in_place:                    # the denominator, then the update, in the gradients
                denom = grads
                for v, d in zip(v_new, denom):
                    torch.sqrt(v, out=d)
            else:
                denom = torch._foreach_sqrt(v_new)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            if in_place:
                for m, d in zip(m_new, denom):
                    torch.div(m, d, out=d)
                upd = denom
            else:
                upd = torch._foreach_div(m_new, denom)
            torch._foreach_div_(upd, bc1)
            for k, i in enumerate(group):
                mu[i], nu[i], out[i] = m_new[k], v_new[k], upd[k]
        unflat = lambda leaves: tree_unflatten(spec, leaves)  # noqa: E731
        new_updates = updates if in_place and all(o is g for o, g in zip(out, g_leaves)) else unflat(out)
        return new_updates, ScaleByAdamState(count=count, mu=unflat(mu), nu=unflat(nu))

    return transform(init, update, FRESH)
