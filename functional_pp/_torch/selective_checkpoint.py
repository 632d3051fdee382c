"""torch's selective activation checkpointing, with the policy shown each kept result.

``create_selective_checkpoint_contexts(policy)`` asks ``policy(ctx, op, *args)`` which results
of a checkpointed region to keep. From torch 2.13 on (checked in 2.13.0 and 2.15.0) the forward
asks after running the op and ``ctx.op_output`` holds its result, which functional_pp's policy
announces as saved for backward (the planner counts it as an activation). Up to torch 2.11 the
forward asks before running the op and the context has no ``op_output``: the dry-run counted
no activation for a selective region (tests/plan/test_plan_selective.py).

:func:`selective_checkpoint_contexts` gives torch's contexts where the capability
:func:`checkpoint_policy_sees_outputs` holds; elsewhere its forward context also asks the policy
again after each op, with ``op_output`` set, its answer unused (torch's own call decides what is
kept). Tested in tests/_torch/test_selective_checkpoint.py.

:func:`outside_selective_checkpoint` runs a block unseen by the selective-checkpoint modes of the
enclosing regions: torch matches a region's recomputation to its forward by counting each op's
calls, so work that a region's forward and its recomputation do differently (an FSDP unit's
gathers, prefetched by the previous layer in forward and issued by the layer itself when
recomputed) must not be counted.

The guard (:class:`_GuardedCaching`, :class:`_GuardedCached`): torch hands the recomputation's
k-th call of a kept op the forward's k-th cached result of that op, whatever the call is; where
the two runs differ (a branch on state that changed in between, work done in one run only) it can
hand a result of another call, a silently wrong gradient. The forward records for each cached
result a small signature (its call's position among the region's ops, the inputs' shapes and
dtypes); the recomputation compares it before taking the result, and a recomputation that ran to
its end must have taken every cached result. A difference raises :class:`SelectiveRecomputeMismatch`
naming the op, the call and the region.
Tested in tests/_torch/test_selective_checkpoint_guard.py."""
from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Any, Callable

import optree
import torch
import torch.utils.checkpoint as _checkpoint

from functional_pp._torch import is_tracing
from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes,
                                          _get_current_dispatch_mode_stack, _pop_mode, _push_mode)
from torch.utils.checkpoint import (CheckpointPolicy, SelectiveCheckpointContext, _CachedTorchDispatchMode,
                                    _CachingTorchDispatchMode, checkpoint, create_selective_checkpoint_contexts)


@functools.cache
def checkpoint_policy_sees_outputs() -> bool:
    """Capability: whether torch's selective checkpoint gives the policy the op's result
    (``ctx.op_output``) in the forward (False on torch 2.11). Probed on one ``sin``."""
    seen = []

    def record(ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            seen.append(getattr(ctx, "op_output", None))
        return CheckpointPolicy.MUST_SAVE

    # probed outside any active dispatch mode (the first ask may come from inside the planner's
    # memory tracker or a fake-tensor trace, which would count or fake the probe's tensors)
    with _disable_current_modes():
        x = torch.ones(2, requires_grad=True)
        checkpoint(torch.sin, x, use_reentrant=False,
                   context_fn=functools.partial(create_selective_checkpoint_contexts, record))
    return any(isinstance(out, torch.Tensor) for out in seen)


class _ShowOutputsToPolicy(TorchDispatchMode):
    """Torch's forward caching mode, plus: after each op, the policy asked again with
    ``ctx.op_output`` set (its answer unused)."""

    def __init__(self, caching: TorchDispatchMode, policy: Callable) -> None:
        super().__init__()
        self.caching, self.policy = caching, policy

    def __enter__(self):
        self.caching.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.caching.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ctx = SelectiveCheckpointContext(is_recompute=False)
        ctx.op_output = out
        self.policy(ctx, func, *args, **kwargs)
        return out


class SelectiveRecomputeMismatch(RuntimeError):
    """A selective-checkpoint region's recomputation issued its kept ops differently from its forward."""


_storage_key = getattr(_checkpoint, "_sac_storage_key", lambda func, args: func)
_RECOMPUTE, _CONSUMED = getattr(_checkpoint, "_RECOMPUTE", None), getattr(_checkpoint, "_CONSUMED", None)
_IGNORED = getattr(_checkpoint, "SAC_IGNORED_OPS", frozenset())
_is_compiling = getattr(_checkpoint, "_is_compiling", lambda func, args, kwargs: False)


def _inputs_signature(args: tuple, kwargs: dict) -> tuple:
    """The shapes and dtypes of an op call's tensor inputs, and its plain scalar arguments."""
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor)
                 else x if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__
                 for x in optree.tree_leaves((args, kwargs), none_is_leaf=True))


def _describe(signature: tuple) -> str:
    position, inputs = signature
    shown = ", ".join(f"{list(x[0])} {str(x[1]).removeprefix('torch.')}"
                      if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype) else repr(x)
                      for x in inputs)
    return f"op #{position} of the region, inputs ({shown})"


def _advice(region: str | None) -> str:
    where = f"layer {region!r}" if region else "the checkpointed region"
    return (f"The forward and the recomputation of {where} under selective activation checkpointing "
            "(remat='selective') issue different ops (a branch on state that changed between them, or work "
            "done in one run only), so torch would hand the recomputation a result cached for another call: "
            "a silently wrong gradient. Make the region compute the same ops both times (run work that "
            "legitimately differs inside functional_pp._torch.selective_checkpoint.outside_selective_checkpoint()), "
            "or use remat=True (full recomputation) for it.")


class _GuardedCaching(_CachingTorchDispatchMode):
    """torch's forward caching mode, plus: a signature recorded for each cached result."""

    def __init__(self, policy_fn: Callable, storage: dict, signatures: dict) -> None:
        super().__init__(policy_fn, storage)
        self.signatures, self.calls = signatures, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _IGNORED or _is_compiling(func, args, kwargs):
            return super().__torch_dispatch__(func, types, args, kwargs)
        key = _storage_key(func, args)
        idx, position = self.func_counter[key], self.calls
        self.calls += 1
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.storage[key].get(idx, _RECOMPUTE) is not _RECOMPUTE:
            self.signatures[key][idx] = (position, _inputs_signature(args, kwargs))
        return out


class _GuardedCached(_CachedTorchDispatchMode):
    """torch's recomputation mode, plus: each cached result handed only to the call whose
    signature it was recorded with, and every cached result taken by a recomputation that ran
    to its end (an early stop, torch's default, may leave the last ones)."""

    def __init__(self, storage: dict, signatures: dict, region: str | None) -> None:
        super().__init__(None, storage)
        self.signatures, self.region, self.calls = signatures, region, 0

    def __enter__(self):
        self.calls = 0
        return super().__enter__()

    def __exit__(self, exc_type, *exc):
        out = super().__exit__(exc_type, *exc)
        if exc_type is None:
            for key, entries in self.storage.items():
                left = [i for i, e in entries.items() if e is not _RECOMPUTE and e is not _CONSUMED]
                if left:
                    raise SelectiveRecomputeMismatch(
                        f"{key}: the recomputation called it {self.func_counter[key]} times, the forward "
                        f"{len(entries)}; call {left[0]} ({_describe(self.signatures[key][left[0]])}) was cached "
                        f"and never taken. {_advice(self.region)}")
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _IGNORED or _is_compiling(func, args, kwargs):
            return super().__torch_dispatch__(func, types, args, kwargs)
        key = _storage_key(func, args)
        idx, position = self.func_counter[key], self.calls
        self.calls += 1
        recorded = self.signatures.get(key, {}).get(idx)
        if recorded is not None and self.storage[key].get(idx) is not _CONSUMED:
            now = (position, _inputs_signature(args, kwargs))
            if now != recorded:
                raise SelectiveRecomputeMismatch(
                    f"{func}: its call {idx} in the recomputation ({_describe(now)}) does not match its call "
                    f"{idx} in the forward ({_describe(recorded)}), whose result is cached. {_advice(self.region)}")
        return super().__torch_dispatch__(func, types, args, kwargs)


@functools.cache
def checkpoint_modes_index_calls() -> bool:
    """Capability: whether torch's selective-checkpoint modes keep the layout the guard reads: per
    op a dict from call index to the cached result or a recompute marker, and a per-op call counter
    (torch 2.13 on). Without it the contexts are torch's own, unguarded."""
    forward, _ = create_selective_checkpoint_contexts([])
    return (_RECOMPUTE is not None and _CONSUMED is not None and hasattr(forward, "func_counter")
            and getattr(forward.storage, "default_factory", None) is dict)


def selective_checkpoint_contexts(policy: Callable[..., Any],
                                  region: str | None = None) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The ``context_fn`` result of ``torch.utils.checkpoint.checkpoint`` for ``policy``, whose
    forward calls see ``ctx.op_output`` on every supported torch, guarded: a recomputation that
    issues a kept op differently from the forward raises :class:`SelectiveRecomputeMismatch`
    (naming ``region``, e.g. the layer's function) instead of taking another call's result."""
    if checkpoint_modes_index_calls():
        storage: dict = defaultdict(dict)
        signatures: dict = defaultdict(dict)
        forward, recompute = _GuardedCaching(policy, storage, signatures), _GuardedCached(storage, signatures, region)
    else:
        forward, recompute = create_selective_checkpoint_contexts(policy)
    if checkpoint_policy_sees_outputs():
        return forward, recompute
    return _ShowOutputsToPolicy(forward, policy), recompute


def _is_selective_mode(mode: Any) -> bool:
    return isinstance(mode, (_CachingTorchDispatchMode, _CachedTorchDispatchMode, _ShowOutputsToPolicy))


@contextlib.contextmanager
def outside_selective_checkpoint():
    """The block runs with this thread's selective-checkpoint dispatch modes (forward caching and
    recomputation) taken off the mode stack, every other mode (a planner's tracker, fake tensors)
    left in place and in order; they are put back after it. Traced (torch.compile), nothing: there
    the selective policy is a graph pass, not dispatch modes (and the mode stack is not traceable)."""
    if is_tracing():
        yield
        return
    stack = _get_current_dispatch_mode_stack()
    first = next((i for i, m in enumerate(stack) if _is_selective_mode(m)), None)
    if first is None:
        yield
        return
    above = [_pop_mode() for _ in range(len(stack) - first)][::-1]
    kept = [m for m in above if not _is_selective_mode(m)]
    for m in kept:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for m in above:
            _push_mode(m)
