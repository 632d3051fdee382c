"""The update phase of a training step: the global gradient norm, the optimizer and the device
side of the non-finite guard (docs/eager_overhead.md "Update phase").

One of three ways, per step:

* **in place** (eager, ``donate_state=True``, an optimizer with an in-place step such as
  ``optim.adamw``): one fused pass writes the new parameters and optimizer state into the
  state passed in, unless the loss or the gradient norm is not finite (a scalar skip);
* **new buffers** (other eager steps): the optimizer works in the step's own gradient buffers
  (docs/memory.md); the state passed in is untouched, and the host returns it for a skipped
  step after the step's one metrics read (``nonfinite.keep_or_raise``);
* **traced**: the pure update, returned as new tensors the host chooses between as above, or,
  with donated state, written into the state passed in under the same scalar guard and, where
  the optimizer has one, its pre-update bound (``optim.update_bound``): a step the bound
  cannot show finite is held (nothing written) and redone by the host in new buffers, as an
  in-place step is. Nothing the writes depend on needs the whole update first, so the
  compiler makes one pass over the state (docs/compile.md "The update phase").

A step that returns new buffers checks the update's finiteness after computing it. A donated
compiled step of an optimizer without a bound checks the values written; one found non-finite
has already been written, and the host stops the run (``nonfinite.keep_or_raise``).

Mechanism: Optimizer update (the update phase: gradient norm, optimizer, device side of the guard).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from functional_pp import optim
from functional_pp._torch import is_tracing
from functional_pp.core.tree import tree_leaves, tree_map, tree_unflatten
from functional_pp.ops.realize import computed_once
from functional_pp.optim.bounds import carried_norms, grad_and_bound_norms
from functional_pp.parallel.collectives import psum
from functional_pp.step.buffers import acc_dtype, keep_if, own_buffers, write_into
from functional_pp.step.nonfinite import nonfinite_flags

AxisGroups = list   # [(mesh axes, leaf indices)]: the leaves split over exactly those axes


@dataclass
class Updated:
    """What the update phase returns: the new parameters and optimizer state (the very tensors
    passed in when ``written``), the global gradient norm, the non-finite flags and whether
    the step counts as finite. ``retry`` (eager in place only): makes the update in new
    buffers instead, for a step whose in-place step held itself back (``flags["update_held"]``;
    a held compiled step has none: the host runs the whole step again without donation)."""
    params: Any
    opt_state: Any
    grad_norm: torch.Tensor
    flags: dict
    finite: torch.Tensor
    written: bool
    retry: Callable[[], "Updated"] | None = None
    peaks: list | None = None     # the carried peaks of the bound's terms after this step (given ``peaks``)


def update_phase(optimizer: optim.GradientTransformation, grads: list[torch.Tensor], treespec: Any, params: Any,
                 opt_state: Any, loss: torch.Tensor, groups: AxisGroups, *, donate_state: bool,
                 params_finite: torch.Tensor | None = None, peaks: list | None = None,
                 reduce_on: torch.device | None = None) -> Updated:
    """Apply ``optimizer`` to the reduced gradients ``grads`` (leaves in ``treespec`` order; the
    list is consumed: emptied, so that only the update holds them) of ``params``; ``loss`` is
    the step's loss and ``groups`` the leaves grouped by the mesh axes that split them (what
    completes a norm across devices). ``params_finite``: whether this device's ``params`` are
    all finite, where the caller knows (``step/known_finite.py``; else a bound that needs it reads
    them). ``peaks``: per leaf, a bound of the largest magnitude of the optimizer's bound terms on
    this device (``optim.bounds.term_peaks``, carried from step to step: a traced donated step
    then reads no term; docs/optim.md "Peaks carried instead of read"); the result's ``peaks``
    are those after this step. ``reduce_on``: the device whose collectives complete the norms
    and checks of an update running elsewhere (CPU offload: NCCL reduces no host tensor)."""
    leaves = tree_leaves(params)
    tracing = is_tracing()
    groups = [(axes, group, reduce_on) for axes, group in groups]

    def sq_reducer(sq_sums: Any) -> torch.Tensor:
        return complete(tree_leaves(sq_sums), groups)

    # eager: the optimizer may overwrite the step's own gradient buffers
    grad_tree = tree_unflatten(treespec, grads if tracing else own_buffers(grads, leaves))
    grads.clear()
    written = tracing and donate_state
    bound = optim.update_bound(optimizer) if written else None
    carry = bound is not None and peaks is not None and bound.carried is not None
    if carry:               # the bound's norm from the gradients' sums and the carried peaks: no other read
        grad_norm, bound_n, grad_sq = carried_norms(bound, tree_leaves(grad_tree), peaks, params, sq_reducer,
                                                    params_finite)
    elif bound is not None:   # the bound's norm, known before the update, read with the gradients' (one loop)
        grad_norm, bound_n = grad_and_bound_norms(bound, tree_leaves(grad_tree), opt_state, params, sq_reducer,
                                                  params_finite)
    else:
        grad_norm = optim.global_norm(grad_tree, sq_reducer)
    finite = torch.isfinite(loss), torch.isfinite(grad_norm)     # known before the update (once: the flags' too)
    ok = finite[0] & finite[1]
    in_place = optim.in_place_step(optimizer) if donate_state and not tracing else None
    held = (in_place(grad_tree, opt_state, params, skip=~ok, grad_norm=grad_norm, norm_reducer=sq_reducer,
                     params_finite=params_finite)
            if in_place is not None else None)
    if held is not None:        # written in place, or held back where it could not be shown finite

        def retry() -> Updated:
            return _in_new_buffers(optimizer, grad_tree, params, opt_state, finite, groups, grad_norm, ok,
                                   sq_reducer)
        flags = {**nonfinite_flags(*finite), "update_held": held}
        return Updated(params, opt_state, grad_norm, flags, ok & ~held, True, retry)
    shown = bound.shows_finite(bound_n, opt_state, params) if bound is not None else None
    up = _in_new_buffers(optimizer, grad_tree, params, opt_state, finite, groups, grad_norm, ok, sq_reducer,
                         check=not written)
    if written:
        # scalars only: the writes wait for no reduction over the update (one pass)
        write = ok & shown if shown is not None else ok
        # computed once, not inside every leaf's update loop (docs/compile.md "The write guard computed once")
        write = computed_once(write)
        up.params = write_into(params, tree_map(lambda new, old: keep_if(write, new, old), up.params, params))
        up.opt_state = write_into(opt_state, tree_map(lambda new, old: keep_if(write, new, old), up.opt_state,
                                                      opt_state))
        if shown is not None:
            # held (nothing written) where the bound could not show the update finite: the host
            # makes it in new buffers, as after the eager in-place step (docs/optim.md "Bound
            # before the update")
            flags = {**nonfinite_flags(*finite), "update_held": ok & ~shown}
            up.flags, up.finite, up.written = flags, write, True
            if carry:     # advanced where written; a held or skipped step leaves the terms as they were
                up.peaks = [torch.where(write, new, old)
                            for new, old in zip(bound.carried.advance(peaks, grad_sq, opt_state), peaks)]
            return up
        # no bound: checked as written (the old values where skipped), a reduction that reads the
        # stored parameters instead of computing the update a second time
        update_ok = all_finite(tree_leaves(up.params), groups)
        up.flags, up.finite, up.written = nonfinite_flags(*finite, update_ok), ok & update_ok, True
    return up


def _in_new_buffers(optimizer, grad_tree, params, opt_state, finite, groups, grad_norm, ok, sq_reducer,
                    check: bool = True) -> Updated:
    """The pure update (eager: in the step's own gradient buffers), then (``check``) its finiteness
    (``finite``: whether the loss and the gradients' norm are finite)."""
    donate = not is_tracing()
    updates, new_opt = optim.update_with(optimizer, grad_tree, opt_state, params, norm_reducer=sq_reducer,
                                         donate_updates=donate, grad_norm=grad_norm)
    new_params = optim.apply_updates(params, updates, donate_updates=optim.returns_fresh(optimizer, donate))
    updates = None
    if not check:
        return Updated(new_params, new_opt, grad_norm, nonfinite_flags(*finite), ok, False)
    update_ok = all_finite(tree_leaves(new_params), groups)
    return Updated(new_params, new_opt, grad_norm, nonfinite_flags(*finite, update_ok), ok & update_ok, False)


def complete(values: list[torch.Tensor], groups: AxisGroups) -> torch.Tensor:
    """The sum of per-leaf 0-dim ``values``, each group's partial sum completed over the mesh
    axes that split its leaves (one all-reduce per group; on the group's third entry, a device,
    where it has one: values on the host reduced on the compute device)."""
    acc = acc_dtype(values)
    total = None
    for axes, group, *on in groups:
        part = [values[i] for i in group]
        value = (torch.stack(part).sum() if len(part) > 1 else part[0]).to(acc)
        if axes and on and on[0] is not None and on[0] != value.device:
            value = psum(value.to(on[0]), axes).to(value.device)
        elif axes:
            value = psum(value, axes)
        total = value if total is None else total + value
    return total if total is not None else torch.zeros((), dtype=acc, device=values[0].device if values else None)


def all_finite(leaves: list[torch.Tensor], groups: AxisGroups) -> torch.Tensor:
    """Whether every element of ``leaves`` is finite on every device (0-dim bool), completed across
    devices per group of leaves as the gradient norm is (:func:`complete`). Traced: each leaf's
    largest magnitude ``abs().amax()`` as 0 or inf, exact (no overflow: a finite parameter up to
    the dtype's largest value passes, as the pre-update bound lets it, docs/optim.md "Bound
    before the update"; one reduction, as cheap as the sum it replaces; ``(u * 0).sum()`` was
    folded to 0 by inductor, which then applied infinite updates, and a count of non-finite
    elements cost 10% of the 20 M model's compiled step: tests/step/test_nonfinite_guard.py,
    docs/compile.md). Eager: the foreach 2-norm of each leaf times 0 (NaN iff the leaf holds a
    NaN or inf or its norm overflows, beyond about 1.8e19 in fp32: conservative there; the
    infinity-norm is 10-15x slower on the CPU, docs/eager_overhead.md)."""
    if is_tracing():
        values = [torch.where(torch.isfinite(u.abs().amax()), 0.0, math.inf) if u.numel()
                  else torch.zeros((), device=u.device) for u in leaves]      # (empty: no amax)
    else:
        values = list(torch._foreach_mul(torch._foreach_norm(leaves, 2), 0.0)) if leaves else []
    return torch.isfinite(complete(values, groups))


def redo_held(retry: Callable[[], Updated], skipped_before: torch.Tensor, metrics: dict) -> tuple:
    """Host side, after the step's metrics read, for a step whose in-place step held itself
    back (nothing was written): the update made in new buffers instead, as an eager step
    without donation makes it, and its flags read (a second transfer, for such steps only).
    Returns the new parameters, optimizer state, skipped-step counter and metrics."""
    up = retry()
    skip = (~up.finite).to(torch.int64)
    skipped, nonfinite_update = torch.stack([skip, up.flags["nonfinite_update"].to(torch.int64)]).tolist()
    metrics = {**metrics, "skipped": skipped, "nonfinite_update": nonfinite_update}
    return up.params, up.opt_state, skipped_before + skip, metrics
