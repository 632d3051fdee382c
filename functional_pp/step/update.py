"""The update phase of a training step: the global gradient norm, the optimizer and the device
side of the non-finite guard (docs/eager_overhead.md "Update phase").

One of three strategies, chosen once when the step is built (:func:`choose_update`, from
``donate_state``, ``compile`` and what the optimizer declares), each with one :meth:`apply`:

* :class:`InPlace` (eager, ``donate_state=True``, an optimizer with an in-place step such as
  ``optim.adamw``): one fused pass writes the new parameters and optimizer state into the
  state passed in, unless the loss or the gradient norm is not finite (a scalar skip); a step
  the in-place step held back (its bound could not show it finite) is made again by the host
  as the eager step without donation (:meth:`UpdateStrategy.redo`);
* :class:`InNewBuffers` (other eager steps, and traced steps without donation): the optimizer
  works in the step's own gradient buffers (docs/memory.md); the state passed in is untouched,
  and the host returns it for a skipped step after the step's one metrics read
  (``nonfinite.keep_or_raise``); traced, the pure update returned as new tensors;
* :class:`WrittenUnderGuard` (a compiled step with ``donate_state=True``): the pure update,
  written into the state passed in under the same scalar guard and, where the optimizer has
  one, its pre-update bound (``optim.update_bound``): a step the bound cannot show finite is
  held (nothing written) and the host runs it again as the compiled step without donation
  (:meth:`UpdateStrategy.redo`, the eager in-place step's redo too). Nothing the writes depend
  on needs the whole update first, so the compiler makes one pass over the state
  (docs/compile.md "The update phase").
  Run eager (``TrainStep.trace``), such a step updates as its eager strategy does (``eager``).

A step that returns new buffers checks the update's finiteness after computing it. A donated
compiled step of an optimizer without a bound checks the values written; one found non-finite
has already been written, and the host stops the run (``nonfinite.keep_or_raise``). Under
``offload_params`` the update runs on the host and ``reduce_on`` names the device whose
collectives complete its norms and checks.

Mechanism: Optimizer update (the update strategies, chosen when the step is built: gradient norm, optimizer, device side of the guard).
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
from functional_pp.optim.bounds import UpdateBound, carried_norms, grad_and_bound_norms
from functional_pp.optim.clipping import sq_sums
from functional_pp.parallel.collectives import psum
from functional_pp.step.buffers import acc_dtype, keep_if, own_buffers, write_into
from functional_pp.step.nonfinite import nonfinite_flags

AxisGroups = list   # [(mesh axes, leaf indices)]: the leaves split over exactly those axes


@dataclass
class Updated:
    """What the update phase returns: the new parameters and optimizer state (the very tensors
    passed in when ``written``), the global gradient norm, the non-finite flags and whether
    the step counts as finite. A step held back (``flags["update_held"]``: nothing written) is
    made again by the host (:meth:`UpdateStrategy.redo`)."""
    params: Any
    opt_state: Any
    grad_norm: torch.Tensor
    flags: dict
    finite: torch.Tensor
    written: bool
    peaks: list | None = None     # the carried peaks of the bound's terms after this step (given ``peaks``)
    skip: torch.Tensor | None = None     # ``~finite``, where the update phase has it (no op to negate ``finite``)


class UpdateStrategy:
    """How a step applies its optimizer (chosen once, :func:`choose_update`). :meth:`apply`
    applies ``optimizer`` to the reduced gradients ``grads`` (leaves in ``treespec`` order; the
    list is consumed: emptied, so that only the update holds them) of ``params``; ``loss`` is
    the step's loss and ``groups`` the leaves grouped by the mesh axes that split them (what
    completes a norm across devices). ``params_finite``: whether this device's ``params`` are
    all finite, where the caller knows (``step/known_finite.py``; else a bound that needs it
    reads them). ``peaks``: per leaf, a bound of the largest magnitude of the optimizer's bound
    terms on this device (``optim.bounds.term_peaks``, carried from step to step: a traced
    donated step then reads no term; docs/optim.md "Peaks carried instead of read"); the
    result's ``peaks`` are those after this step. ``reduce_on``: the device whose collectives
    complete the norms and checks of an update running elsewhere (CPU offload: NCCL reduces no
    host tensor). ``param_leaves``: the leaves of ``params`` where the caller has flattened them
    (the step does, once: no other flatten of the parameters here)."""

    optimizer: optim.GradientTransformation
    eager: "UpdateStrategy"                # this step's device function run eager: itself, but for a compiled step's
    without_donation: "UpdateStrategy"     # the same step without donation (in new buffers)

    def apply(self, grads: list[torch.Tensor], treespec: Any, params: Any, opt_state: Any, loss: torch.Tensor,
              groups: AxisGroups, *, params_finite: torch.Tensor | None = None, peaks: list | None = None,
              reduce_on: torch.device | None = None, param_leaves: list | None = None) -> Updated:
        raise NotImplementedError

    def redo(self, step: Any, state: dict, batch: dict) -> Updated:
        """The host's redo of a step this strategy held back (``flags["update_held"]``: nothing
        written, the state passed in untouched): ``step``'s device function run again on
        ``state`` without donation (``TrainStep.run_without_donation``: compiled where the step
        is, a second graph compiled at the first held step, else eager), updating with
        :attr:`without_donation`: the update in new buffers, checked as such a step checks it.
        The one redo of :class:`InPlace` and :class:`WrittenUnderGuard`."""
        out = step.run_without_donation(state, batch)
        m = out.metrics
        return Updated(out.params, out.opt_state, m["grad_norm"], {"nonfinite_update": m["nonfinite_update"]},
                       m["skipped"] == 0, False)


class InNewBuffers(UpdateStrategy):
    """The pure update (eager: in the step's own gradient buffers), then its finiteness checked."""

    def __init__(self, optimizer: optim.GradientTransformation):
        self.optimizer, self.eager, self.without_donation = optimizer, self, self

    def redo(self, step: Any, state: dict, batch: dict) -> Updated:
        """Never called: an update in new buffers is never held (its state passed in untouched)."""
        raise RuntimeError(f"an update {type(self).__name__} makes is never held, so never redone")

    def apply(self, grads, treespec, params, opt_state, loss, groups, *, params_finite=None, peaks=None,
              reduce_on=None, param_leaves=None) -> Updated:
        groups, sq_reducer, gs, grad_norm, bad, skip = _norm_and_checks(grads, params, loss, groups, reduce_on,
                                                                        param_leaves)
        return _in_new_buffers(self.optimizer, tree_unflatten(treespec, gs), params, opt_state, bad, groups,
                               grad_norm, ~skip, sq_reducer)


class InPlace(UpdateStrategy):
    """Eager, donated: the optimizer's in-place step writes into the state passed in; a step
    it held back is made again by the host as the eager step without donation (:meth:`redo`)."""

    def __init__(self, optimizer: optim.GradientTransformation, step_in_place: Callable[..., Any]):
        self.optimizer, self.step_in_place = optimizer, step_in_place
        self.eager, self.without_donation = self, InNewBuffers(optimizer)
        self.optional = _accepted_keywords(step_in_place)

    def _held(self, held: Any, skip: torch.Tensor) -> torch.Tensor:
        """The step's ``held`` as a 0-dim bool tensor: None or False (written, or left as it was
        where skipped) is not held; anything else is refused naming the contract."""
        if held is None or held is False:
            return torch.zeros_like(skip)
        if held is True:
            return torch.ones_like(skip)
        if isinstance(held, torch.Tensor) and held.dim() == 0 and held.dtype == torch.bool:
            return held
        what = (f"a {held.dtype} tensor of shape {tuple(held.shape)}" if isinstance(held, torch.Tensor)
                else f"{type(held).__name__} {held!r}")
        raise TypeError(f"the optimizer's in-place step ({_name(self.step_in_place)}) returned {what}; it returns "
                        f"None where it wrote the update, a 0-dim bool tensor 'held' (true: it wrote nothing, the "
                        f"update is made again in new buffers) or optim.DECLINED where it does not apply, having "
                        f"touched nothing (docs/optim.md \"In place\")")

    def apply(self, grads, treespec, params, opt_state, loss, groups, *, params_finite=None, peaks=None,
              reduce_on=None, param_leaves=None) -> Updated:
        if param_leaves is None:
            param_leaves = tree_leaves(params)
        groups, sq_reducer, gs, grad_norm, bad, skip = _norm_and_checks(grads, params, loss, groups, reduce_on,
                                                                        param_leaves)
        # the leaves passed as they are (the step's in-place contract takes lists): no tree built, none flattened
        optional = dict(norm_reducer=sq_reducer, params_finite=params_finite, leaves=(param_leaves, gs))
        if self.optional is not None:     # (the optional keywords the step takes)
            optional = {k: v for k, v in optional.items() if k in self.optional}
        held = self.step_in_place(gs, opt_state, params, skip=skip, grad_norm=grad_norm, **optional)
        if isinstance(held, str) and held == optim.DECLINED:     # touched nothing: the update in new buffers
            return _in_new_buffers(self.optimizer, tree_unflatten(treespec, gs), params, opt_state, bad, groups,
                                   grad_norm, ~skip, sq_reducer)
        held = self._held(held, skip)
        flags = {**nonfinite_flags(*bad), "update_held": held}
        skipped = skip | held      # (nothing written: skipped or held)
        return Updated(params, opt_state, grad_norm, flags, ~skipped, True, skip=skipped)


class WrittenUnderGuard(UpdateStrategy):
    """Traced, donated: the pure update written into the state passed in where the scalar guard
    and the optimizer's ``bound`` (None: checked as written) allow; a held step made again by
    the compiled step without donation (:meth:`redo`). ``eager``: the strategy the same step
    updates with when its device function runs eager."""

    def __init__(self, optimizer: optim.GradientTransformation, bound: UpdateBound | None,
                 eager: UpdateStrategy):
        self.optimizer, self.bound, self.eager = optimizer, bound, eager
        self.without_donation = InNewBuffers(optimizer)

    def apply(self, grads, treespec, params, opt_state, loss, groups, *, params_finite=None, peaks=None,
              reduce_on=None, param_leaves=None) -> Updated:
        groups, sq_reducer = _reduction(groups, reduce_on)
        grad_tree = _grad_tree(grads, treespec, params)
        bound = self.bound
        carry = bound is not None and peaks is not None and bound.carried is not None
        if carry:               # the bound's norm from the gradients' sums and the carried peaks: no other read
            grad_norm, bound_n, grad_sq = carried_norms(bound, tree_leaves(grad_tree), peaks, params, sq_reducer,
                                                        params_finite)
        elif bound is not None:   # the bound's norm, known before the update, read with the gradients' (one loop)
            grad_norm, bound_n = grad_and_bound_norms(bound, tree_leaves(grad_tree), opt_state, params, sq_reducer,
                                                      params_finite)
        else:
            grad_norm = optim.global_norm(grad_tree, sq_reducer)
        bad = nonfinite_scalar(loss), nonfinite_scalar(grad_norm)     # known before the update (once: the flags' too)
        ok = ~(bad[0] | bad[1])
        shown = bound.shows_finite(bound_n, opt_state, params) if bound is not None else None
        up = _in_new_buffers(self.optimizer, grad_tree, params, opt_state, bad, groups, grad_norm, ok, sq_reducer,
                             check=False)
        # scalars only: the writes wait for no reduction over the update (one pass)
        write = ok & shown if shown is not None else ok
        # computed once, not inside every leaf's update loop (docs/compile.md "The write guard computed once")
        write = computed_once(write)
        up.params = write_into(params, tree_map(lambda new, old: keep_if(write, new, old), up.params, params))
        up.opt_state = write_into(opt_state, tree_map(lambda new, old: keep_if(write, new, old), up.opt_state,
                                                      opt_state))
        if shown is not None:
            # held (nothing written) where the bound could not show the update finite: the host
            # makes it in new buffers (:meth:`redo`; docs/optim.md "Bound before the update")
            flags = {**nonfinite_flags(*bad), "update_held": ok & ~shown}
            up.flags, up.finite, up.written = flags, write, True
            if carry:     # advanced where written; a held or skipped step leaves the terms as they were
                up.peaks = [torch.where(write, new, old)
                            for new, old in zip(bound.carried.advance(peaks, grad_sq, opt_state), peaks)]
            return up
        # no bound: checked as written (the old values where skipped), a reduction that reads the
        # stored parameters instead of computing the update a second time
        update_ok = all_finite(tree_leaves(up.params), groups)
        up.flags, up.finite, up.written = nonfinite_flags(*bad, update_ok), ok & update_ok, True
        return up


def _accepted_keywords(fn: Callable[..., Any]) -> set[str] | None:
    """The keyword names ``fn`` takes (None: any, ``**kwargs``); an in-place step that does not take
    ``skip`` and ``grad_norm`` is refused naming the contract."""
    import inspect
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):      # (a builtin without a signature: given every keyword)
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    missing = [k for k in ("skip", "grad_norm") if k not in names]
    if missing:
        raise TypeError(f"the optimizer's in-place step ({_name(fn)}) takes no {' or '.join(missing)} keyword: it is "
                        f"called step(grads, state, params, *, skip, grad_norm[, norm_reducer, params_finite, leaves]) "
                        f"(docs/optim.md \"In place\")")
    return names


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def choose_update(optimizer: optim.GradientTransformation, *, donate_state: bool, compiled: bool = False,
                  bound: UpdateBound | None = None) -> UpdateStrategy:
    """The update strategy of a step, chosen once when it is built: ``donate_state`` (the caller
    gives up the state passed in), ``compiled`` (the step's device function compiled whole) and
    what ``optimizer`` declares (an in-place step, ``optim.in_place_step``; ``bound``, its
    pre-update bound, ``optim.update_bound``, looked up by the caller)."""
    step_in_place = optim.in_place_step(optimizer) if donate_state else None
    eager = InPlace(optimizer, step_in_place) if step_in_place is not None else InNewBuffers(optimizer)
    if donate_state and compiled:
        return WrittenUnderGuard(optimizer, bound, eager)
    return eager


def _norm_and_checks(grads: list[torch.Tensor], params: Any, loss: torch.Tensor, groups: AxisGroups,
                     reduce_on: torch.device | None, param_leaves: list | None = None):
    """What an update without a bound knows before it runs: the groups and the squared-sums reducer
    (:func:`_reduction`), the gradients as the optimizer's own leaves (:func:`_grad_leaves`), their
    global norm (``optim.global_norm``'s, from the leaves: no tree made and flattened again), whether
    the loss and the norm are not finite (computed once: the flags' too) and either (the skip)."""
    groups, sq_reducer = _reduction(groups, reduce_on)
    gs = _grad_leaves(grads, params, param_leaves)
    grad_norm = torch.sqrt(complete(sq_sums(gs), groups))
    bad = nonfinite_scalar(loss), nonfinite_scalar(grad_norm)
    return groups, sq_reducer, gs, grad_norm, bad, bad[0] | bad[1]


def nonfinite_scalar(x: torch.Tensor) -> torch.Tensor:
    """Whether a 0-dim float value is not finite (``~torch.isfinite``). Eager, ``x - x != 0`` (0
    for a finite value, NaN for an inf or NaN): the flag in 2 ops where ``isfinite`` decomposes
    into 4 (abs, ne, eq, mul) and its negation is a fifth; traced, ``~isfinite`` itself (a
    compiler may fold ``x - x`` to 0)."""
    return ~torch.isfinite(x) if is_tracing() else (x - x) != 0


def _reduction(groups: AxisGroups, reduce_on: torch.device | None):
    """The groups with the device their collectives run on, and the squared-sums reducer the
    optimizer's norms use (:func:`complete` over them; a flat list of tensors, what the step's own
    callers pass, is not flattened again)."""
    groups = [(axes, group, reduce_on) for axes, group in groups]

    def sq_reducer(sq_sums: Any) -> torch.Tensor:
        flat = type(sq_sums) is list and all(isinstance(x, torch.Tensor) for x in sq_sums)
        return complete(sq_sums if flat else tree_leaves(sq_sums), groups)
    return groups, sq_reducer


def _grad_leaves(grads: list[torch.Tensor], params: Any, param_leaves: list | None = None) -> list[torch.Tensor]:
    """The gradients as buffers the optimizer may overwrite (eager: ``own_buffers``), the list
    ``grads`` emptied."""
    if is_tracing():
        out = list(grads)
    else:
        out = own_buffers(grads, tree_leaves(params) if param_leaves is None else param_leaves)
    grads.clear()
    return out


def _grad_tree(grads: list[torch.Tensor], treespec: Any, params: Any) -> Any:
    """The gradients as a tree, the list emptied (eager: the optimizer may overwrite the step's
    own gradient buffers)."""
    return tree_unflatten(treespec, _grad_leaves(grads, params))


def _in_new_buffers(optimizer, grad_tree, params, opt_state, bad, groups, grad_norm, ok, sq_reducer,
                    check: bool = True) -> Updated:
    """The pure update (eager: in the step's own gradient buffers), then (``check``) its finiteness
    (``bad``: whether the loss and the gradients' norm are not finite; ``ok``: neither is)."""
    donate = not is_tracing()
    updates, new_opt = optim.update_with(optimizer, grad_tree, opt_state, params, norm_reducer=sq_reducer,
                                         donate_updates=donate, grad_norm=grad_norm)
    new_params = optim.apply_updates(params, updates, donate_updates=optim.returns_fresh(optimizer, donate))
    updates = None
    if not check:
        return Updated(new_params, new_opt, grad_norm, nonfinite_flags(*bad), ok, False)
    update_ok = all_finite(tree_leaves(new_params), groups)
    return Updated(new_params, new_opt, grad_norm, nonfinite_flags(*bad, update_ok), ok & update_ok, False)


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


def redo_held(up: Updated, skipped_before: torch.Tensor, metrics: dict) -> tuple:
    """Host side, after the step's metrics read, for a held step (nothing was written) made
    again without donation (``up``, :meth:`UpdateStrategy.redo`): its flags read (a second
    transfer, for such steps only). Returns the new parameters, optimizer state, skipped-step
    counter and metrics."""
    skip = (~up.finite).to(torch.int64)
    skipped, nonfinite_update = torch.stack([skip, up.flags["nonfinite_update"].to(torch.int64)]).tolist()
    metrics = {**metrics, "skipped": skipped, "nonfinite_update": nonfinite_update}
    return up.params, up.opt_state, skipped_before + skip, metrics
