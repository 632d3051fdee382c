"""A step's per-thread state, carried to the thread autograd runs its backward on.

Simulated devices are threads, so the ambient state of a device (rules, op options such as
the mixed-precision ``reduce_dtype``, FSDP units and their reduce-scatters in flight, gradient
buckets, comm reports, pending checks) lives in per-thread stores (``core.runtime.per_thread``).
On CUDA the autograd engine runs the backward functions of CUDA tensors on its own device
thread, which sees none of it: with ``precision="bf16"`` an FSDP gradient reduce-scatter ran in
bf16 instead of the configured fp32, and comm reports missed every backward collective
(tests/devices/test_backward_thread.py, docs/gpu.md). :func:`carry_to_backward` marks a loss so
that the first backward function, wherever it runs, adopts the forward thread's state.
"""
from __future__ import annotations

import threading

import torch

from functional_pp._torch import is_tracing
from functional_pp.core.runtime import per_thread_stores

__all__ = ["carry_to_backward"]


def _snapshot() -> dict[str, dict]:
    return {name: dict(store.__dict__) for name, store in per_thread_stores().items()}


def _adopt(snapshot: dict[str, dict]) -> None:
    """Make this thread's stores hold ``snapshot``'s values (what an earlier step left on this
    thread is replaced)."""
    stores = per_thread_stores()
    for name, values in snapshot.items():
        store = stores[name]
        store.__dict__.clear()
        store.__dict__.update(values)


class _CarryState(torch.autograd.Function):
    """Identity on the loss; its backward, the first of the pass, adopts the forward thread's
    per-thread state when it runs on another thread."""

    @staticmethod
    def forward(ctx, loss, snapshot, ident):
        ctx.snapshot, ctx.ident = snapshot, ident
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, g):
        if threading.get_ident() != ctx.ident:
            _adopt(ctx.snapshot)
        ctx.snapshot = None
        return g, None, None


def carry_to_backward(loss: torch.Tensor) -> torch.Tensor:
    """``loss``, whose backward pass sees the per-thread state of this thread (the state when
    this is called) on whichever thread autograd runs it. Traced (torch.compile) and for a
    loss without a graph: ``loss`` itself (a compiled step runs its backward in its graph)."""
    if is_tracing() or not loss.requires_grad:
        return loss
    return _CarryState.apply(loss, _snapshot(), threading.get_ident())
