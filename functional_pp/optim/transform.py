"""Core optax-style gradient transformations over pytrees of torch tensors.

Conventions
-----------
* Pytrees are nested ``dict``/``list``/``tuple``/``NamedTuple`` containers of
  ``torch.Tensor`` leaves, handled by :mod:`optree` with ``none_is_leaf=False``
  (``None`` is an empty subtree, not a leaf).
* Every transformation is *pure*: ``init`` and ``update`` only use out-of-place
  torch ops, never call ``.item()`` and never branch in Python on tensor values,
  so a training step built from them can be compiled with
  ``torch.compile(fullgraph=True)``.  Step counters are 0-dim ``int64`` tensors
  held in the state, so the value changing every step does not trigger
  recompilation.
* Optimizer state is kept in (at least) fp32: moments of bf16/fp16 params are
  fp32, fp64 params get fp64 state.  State trees that correspond to params
  mirror the param tree exactly (same structure, same leaf shapes), so they can
  be sharded exactly like the params (ZeRO).  Scalar leaves (step counts) are
  separate fields.  :func:`state_like_params` tells the two kinds apart.
* Updates returned by state-carrying transforms (Adam, trace) are in the state
  dtype; :func:`apply_updates` casts the result back to each param's dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import threading
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import optree
import torch

__all__ = [
    "PyTree",
    "Schedule",
    "ScalarOrSchedule",
    "MaskOrFn",
    "GradientTransformation",
    "EmptyState",
    "ScaleByScheduleState",
    "ScaleByAdamState",
    "TraceState",
    "tree_map",
    "apply_updates",
    "chain",
    "identity",
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "scale_by_adam",
    "add_decayed_weights",
    "trace",
    "clip_by_global_norm",
    "global_norm",
    "norm_reducer",
    "get_norm_reducer",
    "decay_mask_by_ndim",
    "resolve_mask",
    "state_like_params",
]

PyTree = Any
Schedule = Callable[[torch.Tensor], torch.Tensor]
ScalarOrSchedule = Union[float, Schedule]
MaskOrFn = Union[PyTree, Callable[[PyTree], PyTree], Callable[[tuple, torch.Tensor], bool], None]


# --------------------------------------------------------------------------- #
# tree helpers
# --------------------------------------------------------------------------- #
def tree_map(fn: Callable[..., Any], tree: PyTree, *rests: PyTree) -> PyTree:
    """``optree.tree_map`` with ``none_is_leaf=False`` (the package convention)."""
    return optree.tree_map(fn, tree, *rests, none_is_leaf=False)


def _tree_leaves(tree: PyTree) -> list:
    return optree.tree_leaves(tree, none_is_leaf=False)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype used for optimizer state of a param of ``dtype``: at least fp32."""
    if not dtype.is_floating_point:
        return torch.float32
    return torch.promote_types(dtype, torch.float32)


def _zeros_state(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, dtype=_state_dtype(p.dtype))


def _new_count(params: PyTree) -> torch.Tensor:
    """0-dim int64 step counter, on the device of the first param leaf."""
    leaves = _tree_leaves(params)
    device = leaves[0].device if leaves and isinstance(leaves[0], torch.Tensor) else None
    return torch.zeros((), dtype=torch.int64, device=device)


# --------------------------------------------------------------------------- #
# GradientTransformation
# --------------------------------------------------------------------------- #
class GradientTransformation(NamedTuple):
    """A pair of pure functions ``(init, update)``.

    ``init(params) -> state`` and
    ``update(grads, state, params=None) -> (updates, new_state)``.
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[..., tuple]


class EmptyState(NamedTuple):
    """State of stateless transformations (an empty pytree node)."""


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: ``count`` is a 0-dim int64 scalar."""

    count: torch.Tensor


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`.

    ``count``: 0-dim int64 scalar (NOT param-like).
    ``mu``/``nu``: first/second moments, mirror the param tree (param-like).
    """

    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    # class attribute (not a field): which fields mirror the params
    param_like_fields = ("mu", "nu")


class TraceState(NamedTuple):
    """State of :func:`trace`: ``trace`` mirrors the param tree (param-like)."""

    trace: PyTree
    param_like_fields = ("trace",)


def identity() -> GradientTransformation:
    """Transformation that returns the updates unchanged."""

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None):
        return updates, state

    return GradientTransformation(init, update)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Return ``params + updates`` (new tensors), cast back to each param's dtype.

    The addition happens in the promoted dtype (e.g. bf16 param + fp32 update is
    added in fp32 and then rounded once to bf16).
    """
    return tree_map(lambda p, u: (p + u).to(p.dtype), params, updates)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations; updates flow through them left to right.

    The state is a tuple with one entry per transformation.
    """

    def init(params: PyTree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: PyTree, state: tuple, params: PyTree = None):
        if len(state) != len(transforms):
            raise ValueError(f"chain: expected state of length {len(transforms)}, got {len(state)}")
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def scale(step_size: float) -> GradientTransformation:
    """Multiply updates by a constant ``step_size`` (dtype of updates kept)."""

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None):
        return tree_map(lambda u: u * step_size, updates), state

    return GradientTransformation(init, update)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply updates by ``step_size_fn(count)``.

    ``count`` is a 0-dim int64 tensor equal to the number of previous updates
    (0 on the first call, as in optax).
    """

    def init(params: PyTree) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=_new_count(params))

    def update(updates: PyTree, state: ScaleByScheduleState, params: PyTree = None):
        s = step_size_fn(state.count)
        s = torch.as_tensor(s)
        new = tree_map(lambda u: u * s.to(device=u.device, dtype=u.dtype), updates)
        return new, ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Scale by ``-learning_rate`` (float or schedule) for gradient descent."""
    m = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda count: m * learning_rate(count))
    return scale(m * learning_rate)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam preconditioning: ``mu_hat / (sqrt(nu_hat) + eps)`` with bias correction.

    Matches ``torch.optim.Adam(W)`` (``eps`` added after the square root of the
    bias-corrected second moment).  Moments are kept in >= fp32 and mirror the
    param tree; the returned updates are in the moment dtype.
    """

    def init(params: PyTree) -> ScaleByAdamState:
        return ScaleByAdamState(
            count=_new_count(params),
            mu=tree_map(_zeros_state, params),
            nu=tree_map(_zeros_state, params),
        )

    def update(updates: PyTree, state: ScaleByAdamState, params: PyTree = None):
        count = state.count + 1
        mu_leaves, spec = optree.tree_flatten(state.mu, none_is_leaf=False)
        nu_leaves = optree.tree_leaves(state.nu, none_is_leaf=False)
        grads = [g.to(m.dtype) for g, m in zip(optree.tree_leaves(updates, none_is_leaf=False), mu_leaves)]
        dtypes = {m.dtype for m in mu_leaves}
        if len(dtypes) != 1 or not mu_leaves:   # mixed state dtypes: per-leaf arithmetic
            return _adam_per_leaf(updates, state, count, b1, b2, eps)
        # one fused (foreach) kernel per stage over all leaves; bias corrections computed once
        c = count.to(device=mu_leaves[0].device, dtype=mu_leaves[0].dtype)
        bc1 = 1.0 - torch.pow(b1, c)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(b2, c))
        mu = torch._foreach_lerp(mu_leaves, grads, 1.0 - b1)
        nu = torch._foreach_addcmul(torch._foreach_mul(nu_leaves, b2), grads, grads, value=1.0 - b2)
        denom = torch._foreach_div(torch._foreach_sqrt(nu), bc2_sqrt)
        torch._foreach_add_(denom, eps)
        new_updates = torch._foreach_div(torch._foreach_div(mu, bc1), denom)
        unflat = lambda leaves: optree.tree_unflatten(spec, list(leaves))  # noqa: E731
        return unflat(new_updates), ScaleByAdamState(count=count, mu=unflat(mu), nu=unflat(nu))

    return GradientTransformation(init, update)


def scale_by_adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, mask: "MaskOrFn" = None) -> GradientTransformation:
    """AdamW in one fused pass per stage (foreach kernels over all leaves): equal to
    ``chain(scale_by_adam, add_decayed_weights(mask), scale_by_learning_rate)`` with fewer
    passes over the parameters. The learning rate (float or schedule of the step count
    before this update) scales the weight decay too, as in ``torch.optim.AdamW``."""
    per_leaf = chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask),
                     scale_by_learning_rate(learning_rate))

    def init(params: PyTree) -> ScaleByAdamState:
        return ScaleByAdamState(count=_new_count(params), mu=tree_map(_zeros_state, params),
                                nu=tree_map(_zeros_state, params))

    def update(updates: PyTree, state: ScaleByAdamState, params: PyTree = None):
        mu_leaves, spec = optree.tree_flatten(state.mu, none_is_leaf=False)
        if len({m.dtype for m in mu_leaves}) != 1:       # mixed dtypes: the per-leaf chain
            sub = (ScaleByAdamState(state.count, state.mu, state.nu), EmptyState(),
                   ScaleByScheduleState(state.count) if callable(learning_rate) else EmptyState())
            new_updates, (adam, _, _) = per_leaf.update(updates, sub, params)
            return new_updates, adam
        if weight_decay and params is None:
            raise ValueError("adamw with weight_decay needs params in update(grads, state, params)")
        count = state.count + 1
        nu_leaves = optree.tree_leaves(state.nu, none_is_leaf=False)
        grads = [g.to(m.dtype) for g, m in zip(optree.tree_leaves(updates, none_is_leaf=False), mu_leaves)]
        dtype, device = mu_leaves[0].dtype, mu_leaves[0].device
        c = count.to(device=device, dtype=dtype)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        lr = torch.as_tensor(lr, dtype=dtype, device=device)
        mu = torch._foreach_lerp(mu_leaves, grads, 1.0 - b1)
        nu = torch._foreach_addcmul(torch._foreach_mul(nu_leaves, b2), grads, grads, value=1.0 - b2)
        denom = torch._foreach_sqrt(nu)
        torch._foreach_div_(denom, torch.sqrt(1.0 - torch.pow(b2, c)))
        torch._foreach_add_(denom, eps)
        new_updates = list(torch._foreach_div(mu, denom))
        torch._foreach_mul_(new_updates, -lr / (1.0 - torch.pow(b1, c)))
        if weight_decay:
            p_leaves = optree.tree_leaves(params, none_is_leaf=False)
            m = resolve_mask(mask, params)
            keep = [True] * len(p_leaves) if m is None else optree.tree_leaves(m, none_is_leaf=False)
            idx = [i for i, k in enumerate(keep) if k]
            if idx:
                decay = torch._foreach_mul([p_leaves[i].to(dtype) for i in idx], -lr * weight_decay)
                sel = [new_updates[i] for i in idx]
                torch._foreach_add_(sel, decay)
                for i, u in zip(idx, sel):
                    new_updates[i] = u
        unflat = lambda leaves: optree.tree_unflatten(spec, list(leaves))  # noqa: E731
        return unflat(new_updates), ScaleByAdamState(count=count, mu=unflat(mu), nu=unflat(nu))

    return GradientTransformation(init, update)


def _adam_per_leaf(updates, state, count, b1, b2, eps):
    mu = tree_map(lambda g, m: torch.lerp(m, g.to(m.dtype), 1.0 - b1), updates, state.mu)
    nu = tree_map(lambda g, v: v * b2 + (1.0 - b2) * torch.square(g.to(v.dtype)), updates, state.nu)

    def precondition(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = count.to(device=m.device, dtype=m.dtype)
        bc1 = 1.0 - torch.pow(b1, c)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(b2, c))
        return (m / bc1) / (torch.sqrt(v) / bc2_sqrt + eps)

    return tree_map(precondition, mu, nu), ScaleByAdamState(count=count, mu=mu, nu=nu)


# --------------------------------------------------------------------------- #
# masks
# --------------------------------------------------------------------------- #
def decay_mask_by_ndim(params: PyTree) -> PyTree:
    """Weight-decay mask: ``True`` for tensors with ``ndim >= 2``.

    1-D tensors (norm scales, biases) and scalars are excluded from decay.
    """
    return tree_map(lambda p: p.ndim >= 2, params)


def _n_positional(fn: Callable) -> Optional[int]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    n = 0
    for prm in sig.parameters.values():
        if prm.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if prm.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            if prm.default is inspect.Parameter.empty:
                n += 1
    return n


def resolve_mask(mask: MaskOrFn, params: PyTree) -> Optional[PyTree]:
    """Turn ``mask`` into a pytree of Python bools matching ``params``.

    ``mask`` may be ``None`` (returns ``None``: everything selected), a pytree of
    bools with the param structure, a ``callable(params) -> such a tree`` or a
    ``callable(path: tuple, leaf) -> bool`` (two required positional args), where
    ``path`` is the optree key path of the leaf (e.g. ``("layers", 0, "w")``).
    Mask leaves must be Python bools (evaluated at trace time under compile).
    """
    if mask is None:
        return None
    if callable(mask):
        if _n_positional(mask) == 2:
            paths, leaves, spec = optree.tree_flatten_with_path(params, none_is_leaf=False)
            return optree.tree_unflatten(spec, [bool(mask(tuple(pth), x)) for pth, x in zip(paths, leaves)])
        return mask(params)
    return mask


def add_decayed_weights(weight_decay: float = 0.0, mask: MaskOrFn = None) -> GradientTransformation:
    """``updates + weight_decay * params`` on leaves selected by ``mask``.

    See :func:`resolve_mask` for the accepted mask forms.  Requires ``params``.
    """

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None):
        if params is None:
            raise ValueError("add_decayed_weights requires params to be passed to update()")
        if weight_decay == 0.0:
            return updates, state
        m = resolve_mask(mask, params)
        if m is None:
            new = tree_map(lambda u, p: u + weight_decay * p, updates, params)
        else:
            new = tree_map(lambda u, p, k: u + weight_decay * p if k else u, updates, params, m)
        return new, state

    return GradientTransformation(init, update)


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``t = g + decay * t``; returns ``t`` (or ``g + decay * t`` if nesterov).

    Identical to ``torch.optim.SGD`` momentum with ``dampening=0``.  The trace
    is kept in >= fp32 and mirrors the param tree.
    """

    def init(params: PyTree) -> TraceState:
        return TraceState(trace=tree_map(_zeros_state, params))

    def update(updates: PyTree, state: TraceState, params: PyTree = None):
        new_trace = tree_map(lambda g, t: g.to(t.dtype) + decay * t, updates, state.trace)
        if nesterov:
            out = tree_map(lambda g, t: g.to(t.dtype) + decay * t, updates, new_trace)
        else:
            out = new_trace
        return out, TraceState(trace=new_trace)

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------- #
# global norm + reducer
# --------------------------------------------------------------------------- #
NormReducer = Callable[[PyTree], torch.Tensor]

_NORM_REDUCER: contextvars.ContextVar[Optional[NormReducer]] = contextvars.ContextVar(
    "functional_pp_norm_reducer", default=None
)
# torch.compile (dynamo) cannot trace ContextVar.get(), but it can trace (and
# guard on) attributes of a threading.local.  norm_reducer() keeps this mirror in
# sync with the ContextVar; it is only read while compiling.
_NORM_REDUCER_MIRROR = threading.local()


def get_norm_reducer() -> Optional[NormReducer]:
    """The reducer installed by :func:`norm_reducer` in this thread/context, or None."""
    if torch.compiler.is_compiling():
        return getattr(_NORM_REDUCER_MIRROR, "fn", None)
    return _NORM_REDUCER.get()


@contextlib.contextmanager
def norm_reducer(fn: Optional[NormReducer]) -> Iterator[None]:
    """Install ``fn`` as the sum-of-squares reducer used by :func:`global_norm`.

    ``fn(sq_sums)`` receives a pytree (same structure as the tree passed to
    ``global_norm``) of 0-dim tensors, the local sum of squares of each leaf,
    and must return the 0-dim global total (e.g. local sum followed by an
    all-reduce over the shard group).  The setting is stored in a
    ``contextvars.ContextVar``, so each thread has its own; ``None`` restores
    the default (plain local sum).  Under ``torch.compile`` the reducer is read
    from a per-thread mirror and guarded on, so changing it recompiles.
    """
    token = _NORM_REDUCER.set(fn)
    prev = getattr(_NORM_REDUCER_MIRROR, "fn", None)
    _NORM_REDUCER_MIRROR.fn = fn
    try:
        yield
    finally:
        _NORM_REDUCER.reset(token)
        _NORM_REDUCER_MIRROR.fn = prev


def _sum_sq(x: torch.Tensor) -> torch.Tensor:
    x = x.to(_state_dtype(x.dtype))
    return torch.sum(x * x)


def global_norm(tree: PyTree) -> torch.Tensor:
    """``sqrt(sum of squares of all leaves)`` as a 0-dim tensor (>= fp32).

    Per-leaf sums of squares are combined by the reducer installed with
    :func:`norm_reducer` (so sharded leaves can be all-reduced), otherwise by a
    plain local sum.
    """
    sq = tree_map(_sum_sq, tree)
    reducer = get_norm_reducer()
    if reducer is not None:
        total = reducer(sq)
    else:
        leaves = _tree_leaves(sq)
        if not leaves:
            return torch.zeros((), dtype=torch.float32)
        dtype = leaves[0].dtype
        for t in leaves[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        total = torch.stack([t.to(dtype) for t in leaves]).sum()
    return torch.sqrt(total)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale updates by ``min(1, max_norm / (global_norm + 1e-6))``.

    Same formula as ``torch.nn.utils.clip_grad_norm_``; the norm comes from
    :func:`global_norm` and hence honours :func:`norm_reducer`.
    """

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None):
        norm = global_norm(updates)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return tree_map(lambda u: u * coef.to(device=u.device, dtype=u.dtype), updates), state

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------- #
# state introspection
# --------------------------------------------------------------------------- #
def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def state_like_params(state: PyTree) -> PyTree:
    """Pytree of bools with the structure of ``state``: ``True`` for param-like leaves.

    Param-like leaves belong to subtrees that mirror the param tree (same
    structure and leaf shapes, e.g. Adam's ``mu``/``nu``, momentum ``trace``)
    and should be sharded exactly like the params (ZeRO).  ``False`` leaves are
    scalars such as step counts (replicate them).  State classes declare their
    param-like fields in a ``param_like_fields`` class attribute.
    """

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
