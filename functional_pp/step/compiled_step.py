"""A training step's device function compiled as one graph (``train_step(compile=True)`` or a
backend name; docs/compile.md): the compile gate every simulated device shares, the natively
traced graphs it runs (step/native_trace.py), and the second graph without donation that
makes a held donated step again in new buffers (docs/optim.md "Bound before the update").
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from functional_pp.parallel.step_backend import step_backend
from functional_pp.compile.gate import CompileGate
from functional_pp.core.policy import Policy
from functional_pp.core.runtime import current_context
from functional_pp.step.native_trace import NativeStep, call_natively, dynamo_traces_step, native_step, run_compiled
from functional_pp.ops import fake_quant

__all__ = ["CompiledStep", "COMPILED_STEPS_PER_PROCESS"]

# every compiled TrainStep of a process adds graphs to the cache of the same function
# (TrainStep._device_step): dynamo's default of 8 per function would refuse the ninth step built in a
# process (a sweep, a notebook, a test session); docs/compile.md "Many steps in one process"
COMPILED_STEPS_PER_PROCESS = 64


class CompiledStep:
    """The compiled forms of one step's device function, made at first use and shared by the
    step's device threads: :meth:`donated` (the step as built) and :meth:`new_buffers` (the
    same function without donation). ``mode``: the step's compile mode (its step part, from
    ``compile.layer_compile.split_mode``); ``policy()``: the step's policy as given (its
    gradient buckets, overlap and collectives in flight pick the backend's passes);
    ``resolved_policy()``: the policy its ops run under (part of a native graph's key)."""

    def __init__(self, mode: Callable[[], Any], policy: Callable[[], Policy], resolved_policy: Callable[[], Policy]):
        self._mode, self._policy, self._resolved_policy = mode, policy, resolved_policy
        self._gates: dict[str, CompileGate] = {}
        self.natives: dict = {}               # natively traced step functions by settings
        self._lock = threading.Lock()

    def donated(self, fn: Callable[..., Any]) -> CompileGate:
        """``fn`` (the device step) compiled once for every device thread."""
        return self._gate("donated", fn)

    def new_buffers(self, fn: Callable[..., Any]) -> CompileGate:
        """``fn`` (the device step without donation) compiled once, at the first held step."""
        return self._gate("new_buffers", fn)

    def _gate(self, which: str, fn: Callable[..., Any]) -> CompileGate:
        with self._lock:     # one wrapper (one backend) for every device thread
            gate = self._gates.get(which)
            if gate is None:
                gate = self._gates[which] = self._compile(fn)
        return gate

    def _compile(self, fn: Callable[..., Any]) -> CompileGate:
        """``fn`` (a device step) compiled, called with ``fn``'s arguments: simulated devices
        share one compilation (compile/gate.py); dynamo sees one opaque call traced natively
        (step/native_trace.py) unless ``FPP_STEP_TRACE=dynamo``; static shapes."""
        policy = self._policy()
        backend = step_backend(self._mode(), policy.bucket_mb, policy.overlap, policy.collectives_in_flight)
        if dynamo_traces_step():
            return CompileGate(torch.compile(fn, backend=backend, fullgraph=True, dynamic=False), fn.__code__)
        return CompileGate(torch.compile(call_natively, backend=backend, fullgraph=True, dynamic=False),
                           call_natively.__code__,
                           call=lambda compiled, *args: run_compiled(compiled, self._native_step(fn, args), args))

    def _native_step(self, fn: Callable[..., Any], args: tuple) -> NativeStep:
        """``fn`` with the structure of ``args`` and what its native trace reads beyond them:
        the mesh, the kind of device, the policy in force, and the device's rank where the
        trace read it (step/native_trace.py)."""
        ctx = current_context(required=False)
        settings = (getattr(ctx, "mesh", None), type(getattr(ctx, "backend", None)).__name__, self._resolved_policy(),
                    fake_quant.enabled())          # (QAT's switch, read by the traced loss: a graph per value)
        step = native_step(fn, settings, args)
        with self._lock:
            step = self.natives.setdefault(step.key, step)
            if step.read_rank is not None and step.read_rank != ctx.rank:    # a graph per device
                step = native_step(fn, (*settings, ctx.rank), args)
                step = self.natives.setdefault(step.key, step)
        return step
