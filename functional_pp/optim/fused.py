"""In-place steps (:func:`functional_pp.optim.base.in_place_step`) on torch's fused kernels:
AdamW as one pass over parameters, gradients and moments (``torch._fused_adamw_``) where the
pure chain makes about twenty (docs/optim.md "In place").

Mechanism: Optimizer update (in place: torch's fused AdamW kernel, for a donated state).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from functional_pp._torch import is_tracing
from functional_pp.core.runtime import new_per_thread

from functional_pp.optim.adam import adamw_states, learning_rate
from functional_pp.optim.base import DECLINED, PyTree, ScalarOrSchedule, ScaleByScheduleState, tree_leaves
from functional_pp.optim.bounds import adamw_bound, bound_norm
from functional_pp.optim.masking import Mask, resolve_mask

FUSED_DEVICES = ("cpu", "cuda")


def adamw_in_place(lr: ScalarOrSchedule, b1: float, b2: float, eps: float, weight_decay: float, mask: Mask,
                   clip_norm: Optional[float]) -> Callable[..., torch.Tensor | str]:
    """The in-place step of ``optim.adamw(lr, b1, b2, eps, weight_decay, mask, clip_norm)``:
    clipping by the given ``grad_norm`` (in the donated gradients), then one
    ``torch._fused_adamw_`` call per (device, dtype, decayed) group of leaves with the
    step's ``skip`` as its ``found_inf`` (the kernel leaves every tensor as it was), then the
    step counters advanced unless skipped.

    A written state cannot be taken back, so the step first bounds what it would write (the
    optimizer's pre-update bound, :func:`functional_pp.optim.bounds.adamw_bound`) and holds
    itself back, changing nothing, where it cannot show the new parameters finite (given
    ``params_finite``, whether the parameters are, it does not read them). It returns
    that ``held`` flag (0-dim bool; the caller then makes the update another way), or
    ``DECLINED``, touching nothing, where the kernel does not apply (a device other than cpu/cuda, a
    non-float leaf, moments of another dtype). ``leaves``: the leaves of ``params`` and ``grads``
    where the caller has them (the training step does: no second flatten)."""

    bound = adamw_bound(lr, b1, eps, weight_decay)
    plans = new_per_thread()     # per device thread: the last state's per-leaf plan (:func:`_plan`)

    def step(grads: PyTree, state: tuple, params: PyTree, *, skip: torch.Tensor,
             grad_norm: torch.Tensor, norm_reducer: Optional[Callable] = None,
             params_finite: Optional[torch.Tensor] = None,
             leaves: Optional[tuple[list, list]] = None) -> torch.Tensor | str:
        adam, schedule = adamw_states(state)
        ps, gs = (tree_leaves(params), tree_leaves(grads)) if leaves is None else leaves
        mus, nus = tree_leaves(adam.mu), tree_leaves(adam.nu)
        if not ps or not _grads_fit(ps, gs):
            return DECLINED
        plan = _plan(plans, ps, mus, nus, mask, params)
        if plan is None:
            return DECLINED
        kernel_groups, by_dtype = plan
        rate = torch.as_tensor(learning_rate(lr, schedule)) if callable(lr) else lr
        n = bound_norm(bound, state, params, grad_norm, norm_reducer, params_finite, leaves=(ps, mus))
        held = ~(skip | bound.shows_finite(n, state, params, leaves=(ps, mus)))      # (~skip & ~shown)
        skip = skip | held
        if clip_norm is not None:    # clip_by_global_norm's formula, in the donated gradients
            coef = torch.clamp(clip_norm / (grad_norm + 1e-6), max=1.0)
            coef = coef.masked_fill(skip, 1.0)     # a held step leaves them as given (one op)
            for group in by_dtype:      # (the gradients' devices and dtypes are their parameters')
                sel = [gs[i] for i in group]
                torch._foreach_mul_(sel, coef.to(device=sel[0].device, dtype=sel[0].dtype))
        for group, decayed in kernel_groups:
            p0 = ps[group[0]]
            found_inf = skip.to(device=p0.device, dtype=torch.float32)
            steps = [(adam.count + 1).to(device=p0.device, dtype=torch.float32)] * len(group)
            group_lr = rate.to(p0.device) if isinstance(rate, torch.Tensor) else rate
            torch._fused_adamw_([ps[i] for i in group], [gs[i] for i in group], [mus[i] for i in group],
                                [nus[i] for i in group], [], steps, lr=group_lr, beta1=b1, beta2=b2,
                                weight_decay=weight_decay if decayed else 0.0, eps=eps,
                                amsgrad=False, maximize=False, found_inf=found_inf)
        advance = ~skip      # (a bool added to the integer counters: one op fewer than a cast)
        adam.count.add_(advance)
        if isinstance(schedule, ScaleByScheduleState):    # (a constant rate has no counter)
            schedule.count.add_(advance)
        return held

    return step


def _plan(plans: Any, ps: list, mus: list, nus: list, mask: Mask, params: PyTree) -> Optional[tuple]:
    """The fused kernel's groups of leaves (indices, decayed) for these parameters and moments and
    their groups by device and dtype, or None where the kernel does not apply to them
    (:func:`_states_fit`). Eager, derived once per device thread and state: kept while the step
    is given the very tensors it was derived for, as a donated step is (a per-leaf walk of about
    60 tensors' devices and dtypes a step, about 0.1 ms for the tiny Llama of
    benchmarks/eager_overhead.py); traced, derived every call."""
    last = None if is_tracing() else getattr(plans, "last", None)
    leaves = (*ps, *mus, *nus)
    if last is not None and len(last[0]) == len(leaves) and all(r() is x for r, x in zip(last[0], leaves)):
        return last[1]
    plan = None
    if _states_fit(ps, mus, nus):
        decay = tree_leaves(resolve_mask(mask, params)) if mask is not None else [True] * len(ps)
        plan = ([(group, bool(decay[group[0]])) for group in _groups(ps, decay)], _groups(ps, [True] * len(ps)))
    if not is_tracing():
        plans.last = ([weakref.ref(x) for x in leaves], plan)
    return plan


def _grads_fit(ps: list, gs: list) -> bool:
    """Whether each gradient is a tensor of its parameter's dtype, shape and device (checked every
    call: the gradients are new tensors every step)."""
    return len(ps) == len(gs) and all(isinstance(g, torch.Tensor) and g.dtype == p.dtype and g.shape == p.shape
                                      and g.device == p.device for p, g in zip(ps, gs))


def _states_fit(ps: list, mus: list, nus: list) -> bool:
    """Whether the fused kernel applies to these parameters and moments: floating tensors on a
    device it runs on, each moment of its parameter's dtype."""
    return all(isinstance(p, torch.Tensor) and p.is_floating_point() and p.device.type in FUSED_DEVICES
               and m.dtype == v.dtype == p.dtype for p, m, v in zip(ps, mus, nus)) and len(ps) == len(mus) == len(nus)


def _groups(leaves: list[torch.Tensor], flags: list[Any]) -> list[list[int]]:
    """Indices grouped by (device, dtype, flag): one fused kernel call each."""
    groups: dict = {}
    for i, (x, f) in enumerate(zip(leaves, flags)):
        groups.setdefault((x.device, x.dtype, bool(f)), []).append(i)
    return list(groups.values())
