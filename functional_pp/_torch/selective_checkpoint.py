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
recomputed) must not be counted."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

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


def selective_checkpoint_contexts(policy: Callable[..., Any]) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The ``context_fn`` result of ``torch.utils.checkpoint.checkpoint`` for ``policy``, whose
    forward calls see ``ctx.op_output`` on every supported torch."""
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
