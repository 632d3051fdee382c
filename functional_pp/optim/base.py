"""The optimizer building blocks shared by every transformation (optax's conventions).

* Pytrees are nested ``dict``/``list``/``tuple``/``NamedTuple`` containers of tensors, handled
  by :mod:`optree` with ``none_is_leaf=False`` (``None`` is an empty subtree, not a leaf).
* A :class:`GradientTransformation` is a pair of pure functions ``init(params) -> state`` and
  ``update(updates, state, params=None, **extra) -> (updates, state)``: no ``.item()``, no
  Python branch on tensor values, so a step built from them compiles with
  ``torch.compile(fullgraph=True)``; step counters are 0-dim ``int64`` tensors in the state.
* Optimizer state is at least fp32 (fp64 parameters get fp64 state); state that corresponds
  to parameters mirrors the parameter tree, so it is sharded like the parameters (ZeRO).
* Extra keyword arguments of ``update`` (docs/optim.md): ``norm_reducer`` (how the global
  norm of sharded gradients is completed) and ``donate_updates`` (the caller will not read
  ``updates`` again: transformations may overwrite them instead of allocating new tensors).
  Transformations built here accept them; :func:`update_with` drops them for others.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple, Union

import torch

from functional_pp.core.tree import (tree_flatten, tree_leaves, tree_map,  # noqa: F401 (tree_map re-exported)
                                     tree_unflatten)

PyTree = Any
Schedule = Callable[[torch.Tensor], torch.Tensor]
ScalarOrSchedule = Union[float, Schedule]

# What a transformation's update returns, for in-place reuse along a chain (docs/optim.md):
FRESH = "fresh"        # new tensors it allocated: the next transformation may overwrite them
INHERIT = "inherit"    # the tensors it was given (possibly modified in place when donated)
ALIASED = "aliased"    # tensors that are also kept elsewhere (e.g. in its state): never overwrite
# what an in-place step (:func:`in_place_step`) returns where it does not apply, having touched
# nothing: the caller makes the update another way (``update`` in new buffers)
DECLINED = "declined"


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of optimizer state for a parameter of ``dtype``: at least fp32."""
    if not dtype.is_floating_point:
        return torch.float32
    return torch.promote_types(dtype, torch.float32)


def zeros_state(p: torch.Tensor) -> torch.Tensor:
    """Zero state for parameter ``p`` (same shape, :func:`state_dtype`)."""
    return torch.zeros_like(p, dtype=state_dtype(p.dtype))


def new_count(params: PyTree) -> torch.Tensor:
    """0-dim int64 step counter, on the device of the first parameter leaf."""
    leaves = tree_leaves(params)
    device = leaves[0].device if leaves and isinstance(leaves[0], torch.Tensor) else None
    return torch.zeros((), dtype=torch.int64, device=device)


# --------------------------------------------------------------------------- validation
def check_number(owner: str, name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, hint: str = "") -> float:
    """``float(value)`` after checking it is a finite number in the given range; otherwise a
    ``ValueError`` naming ``owner`` (the constructor), the argument, its value and the range."""
    where = f"{owner}: {name}={value!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        else:
            raise TypeError(f"{where} must be a number{hint}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{where} is not a finite number{hint}")
    lo_bad = low is not None and (v <= low if low_open else v < low)
    hi_bad = high is not None and (v >= high if high_open else v > high)
    if lo_bad or hi_bad:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        raise ValueError(f"{where} is outside {lo}, {hi}{hint}")
    return v


def check_learning_rate(owner: str, learning_rate: ScalarOrSchedule) -> ScalarOrSchedule:
    """A learning rate is a schedule (checked where it is built) or a finite number >= 0."""
    if callable(learning_rate):
        return learning_rate
    return check_number(owner, "learning_rate", learning_rate, low=0.0,
                        hint=" (a learning rate is a finite number >= 0, e.g. 3e-4)")


# --------------------------------------------------------------------------- transformations
class _Pair(NamedTuple):
    init: Callable[[PyTree], PyTree]
    update: Callable[..., tuple]


class GradientTransformation(_Pair):
    """optax's pair of pure functions ``(init, update)``: ``init(params) -> state`` and
    ``update(updates, state, params=None, **extra) -> (updates, new_state)``. It unpacks as the
    pair (``init, update = t``); what a caller may rely on beyond it is declared on the
    transformation, not stamped on its functions:

    * ``returns``: what ``update`` returns (:data:`FRESH`, :data:`INHERIT` or :data:`ALIASED`);
      None for a plain optax-style ``update(updates, state, params=None)`` without extras;
    * ``in_place``: an implementation of update *and* apply writing into the tensors given
      (:func:`in_place_step`, docs/optim.md), or None;
    * ``bound``: a pre-update bound (:func:`update_bound`), or None.

    ``_replace`` makes a plain pair (the declarations describe the functions they came with)."""

    returns: str | None
    in_place: Callable[..., torch.Tensor | bool | str | None] | None
    bound: Any

    def __new__(cls, init: Callable[[PyTree], PyTree], update: Callable[..., tuple], *,
                returns: str | None = None, in_place: Callable[..., torch.Tensor | bool | str | None] | None = None,
                bound: Any = None) -> "GradientTransformation":
        self = super().__new__(cls, init, update)
        self.returns, self.in_place, self.bound = returns, in_place, bound
        return self

    def __getattr__(self, name: str) -> Any:      # a pair made by _replace/_make declares nothing
        if name in ("returns", "in_place", "bound"):
            return None
        raise AttributeError(name)


def transform(init: Callable[[PyTree], PyTree], update: Callable[..., tuple], returns: str,
              in_place: Callable[..., torch.Tensor | bool | str | None] | None = None,
              bound: Any = None) -> GradientTransformation:
    """A transformation whose ``update`` accepts the extra keyword arguments (``**extra``) and
    returns ``returns`` updates (:data:`FRESH`, :data:`INHERIT` or :data:`ALIASED`), with an
    optional in-place step and pre-update bound (:class:`GradientTransformation`)."""
    return GradientTransformation(init, update, returns=returns, in_place=in_place, bound=bound)


def _declared(t: Any, name: str) -> Any:
    return getattr(t, name, None) if isinstance(t, GradientTransformation) else None


def in_place_step(t: GradientTransformation) -> Callable[..., torch.Tensor | bool | str | None] | None:
    """The transformation's in-place step, or None. ``step(grads, state, params, *, skip,
    grad_norm)`` (lists of tensors for ``grads``/``params``, ``state`` as ``t.init`` made it)
    does what ``update`` followed by :func:`apply_updates` would, writing the new parameters
    into ``params`` and the new state into ``state``'s tensors, and leaves everything as it was
    where the 0-dim bool ``skip`` is true. ``grads`` are donated; ``grad_norm`` is their global
    norm (for clipping). Optional keywords, passed where the step accepts them: ``norm_reducer``
    (completes a sum of squares over the devices, as ``update``'s); ``params_finite`` (0-dim bool)
    tells a step whose bound needs finite parameters whether they are, instead of reading them;
    ``leaves`` (the leaves of ``params`` and ``grads``, where the caller has flattened them) saves a
    flatten of each. It returns None (or False) where it wrote the update (or left everything as
    it was where ``skip``); a 0-dim bool ``held``, true where it held itself back writing nothing
    (the caller then makes the update another way); :data:`DECLINED` where it does not apply,
    having touched nothing (the caller makes the update in new buffers). For callers whose state
    is theirs to overwrite (a donated training state); results equal the pure path's within
    rounding (docs/optim.md "In place")."""
    return _declared(t, "in_place")


def update_bound(t: GradientTransformation) -> Any:
    """The transformation's pre-update bound (an :class:`functional_pp.optim.bounds.UpdateBound`),
    or None: from one global norm of the gradients and tensors of ``params`` and the state, a
    0-dim bool, true only where the parameters ``update`` followed by :func:`apply_updates`
    would make are certainly finite, known before the update is computed and equal on every
    device. A step that writes into its state writes only where it is true (docs/optim.md
    "Bound before the update")."""
    return _declared(t, "bound")


def update_with(t: GradientTransformation, updates: PyTree, state: PyTree, params: PyTree = None,
                **extra: Any) -> tuple:
    """``t.update(updates, state, params, **extra)``, without the extras if ``t`` was not built by
    :func:`transform` (a plain optax-style ``update(updates, state, params=None)``)."""
    if _declared(t, "returns") is None:
        return t.update(updates, state, params)
    return t.update(updates, state, params, **extra)


def returns_fresh(t: GradientTransformation, donated: bool) -> bool:
    """Whether the updates ``t`` returns are tensors nobody else holds, given whether the
    updates it received were (:func:`transform`'s ``returns``)."""
    kind = _declared(t, "returns") or ALIASED
    return kind == FRESH or (kind == INHERIT and donated)


class EmptyState(NamedTuple):
    """State of stateless transformations (an empty pytree node)."""


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: ``count`` is a 0-dim int64 scalar."""

    count: torch.Tensor


class TraceState(NamedTuple):
    """State of :func:`trace`: ``trace`` mirrors the param tree (param-like)."""

    trace: PyTree
    param_like_fields = ("trace",)


def dtype_groups(leaves: list) -> list[list[int]]:
    """Indices of ``leaves`` grouped by (device, dtype), for one foreach kernel per group."""
    groups: dict = {}
    for i, x in enumerate(leaves):
        groups.setdefault((x.device, x.dtype), []).append(i)
    return list(groups.values())


def _scale_leaves(updates: PyTree, factor: Any, donated: bool) -> PyTree:
    """``updates * factor`` (a number or 0-dim tensor), in place when the updates are donated."""
    leaves, spec = tree_flatten(updates)
    out = list(leaves)
    for group in dtype_groups(leaves):
        sel = [leaves[i] for i in group]
        f = factor.to(device=sel[0].device, dtype=sel[0].dtype) if isinstance(factor, torch.Tensor) else factor
        if donated:
            torch._foreach_mul_(sel, f)
        else:
            for i, y in zip(group, torch._foreach_mul(sel, f)):
                out[i] = y
    return tree_unflatten(spec, out) if not donated else updates


def identity() -> GradientTransformation:
    """Transformation that returns the updates unchanged."""

    def update(updates: PyTree, state: EmptyState, params: PyTree = None, **extra: Any):
        return updates, state

    return transform(lambda params: EmptyState(), update, INHERIT)


def scale(step_size: float) -> GradientTransformation:
    """Multiply updates by a constant ``step_size`` (dtype of updates kept)."""
    step_size = check_number("scale", "step_size", step_size)

    def update(updates: PyTree, state: EmptyState, params: PyTree = None, *, donate_updates: bool = False,
               **extra: Any):
        return _scale_leaves(updates, step_size, donate_updates), state

    return transform(lambda params: EmptyState(), update, FRESH)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply updates by ``step_size_fn(count)``; ``count`` (0-dim int64) is the number of
    previous updates (0 on the first call, as in optax)."""
    if not callable(step_size_fn):
        raise TypeError(f"scale_by_schedule: step_size_fn must be callable(count), got {step_size_fn!r}")

    def update(updates: PyTree, state: ScaleByScheduleState, params: PyTree = None, *,
               donate_updates: bool = False, **extra: Any):
        s = torch.as_tensor(step_size_fn(state.count))
        return _scale_leaves(updates, s, donate_updates), ScaleByScheduleState(count=state.count + 1)

    return transform(lambda params: ScaleByScheduleState(count=new_count(params)), update, FRESH)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Scale by ``-learning_rate`` (``+`` if ``flip_sign=False``); a schedule is evaluated at the
    number of previous updates."""
    learning_rate = check_learning_rate("scale_by_learning_rate", learning_rate)
    m = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda count: m * torch.as_tensor(learning_rate(count)))
    return scale(m * learning_rate)


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``t = g + decay * t``; returns ``t`` (or ``g + decay * t`` if nesterov).

    Identical to ``torch.optim.SGD`` momentum with ``dampening=0``. The trace is kept in
    >= fp32 and mirrors the param tree."""
    decay = check_number("trace", "decay", decay, low=0.0, high=1.0, high_open=True,
                         hint=" (the momentum, e.g. 0.9)")

    def update(updates: PyTree, state: TraceState, params: PyTree = None, **extra: Any):
        new_trace = tree_map(lambda g, t: g.to(t.dtype) + decay * t, updates, state.trace)
        out = tree_map(lambda g, t: g.to(t.dtype) + decay * t, updates, new_trace) if nesterov else new_trace
        return out, TraceState(trace=new_trace)

    return transform(lambda params: TraceState(trace=tree_map(zeros_state, params)), update,
                     FRESH if nesterov else ALIASED)


def apply_updates(params: PyTree, updates: PyTree, *, donate_updates: bool = False) -> PyTree:
    """Return ``params + updates`` cast back to each parameter's dtype (the sum is done in the
    promoted dtype, e.g. bf16 + fp32 in fp32, then rounded once). With ``donate_updates`` the
    sum is written into the update tensors whose dtype is the parameter's (no new tensors)."""
    if not donate_updates:
        return tree_map(lambda p, u: (p + u).to(p.dtype), params, updates)
    p_leaves, spec = tree_flatten(params)
    u_leaves = tree_leaves(updates)
    same = [i for i, (p, u) in enumerate(zip(p_leaves, u_leaves)) if p.dtype == u.dtype and p.shape == u.shape]
    if same:
        torch._foreach_add_([u_leaves[i] for i in same], [p_leaves[i] for i in same])
    out = [u if i in set(same) else (p + u).to(p.dtype) for i, (p, u) in enumerate(zip(p_leaves, u_leaves))]
    return tree_unflatten(spec, out)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def state_like_params(state: PyTree) -> PyTree:
    """Pytree of bools with the structure of ``state``: ``True`` for param-like leaves.

    Param-like leaves belong to subtrees that mirror the param tree (Adam's ``mu``/``nu``,
    momentum ``trace``) and are sharded exactly like the params (ZeRO); ``False`` leaves are
    scalars such as step counts (replicated). State classes declare their param-like fields
    in a ``param_like_fields`` class attribute."""

    def walk(s: Any, like: bool) -> Any:
        if like or isinstance(s, torch.Tensor):
            return tree_map(lambda _: like, s)
        if _is_namedtuple(s):
            fields = getattr(type(s), "param_like_fields", ())
            return type(s)(*(walk(v, f in fields) for f, v in zip(s._fields, s)))
        if type(s) in (tuple, list):
            return type(s)(walk(v, False) for v in s)
        if type(s) is dict:
            return {k: walk(v, False) for k, v in s.items()}
        return tree_map(lambda _: False, s)

    return walk(state, False)
