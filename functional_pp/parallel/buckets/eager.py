"""Bucketed, asynchronous data-parallel gradient reduction (docs/communication.md, "Buckets").

A parameter that meets data varying over data-parallel axes is cast to varying
(``collectives.pvary``); the transpose of that cast is the gradient's all-reduce. Inside
:func:`grad_buckets` (the training step's backward), that transpose does not reduce at
once: it copies the local gradient into a bucket and hands autograd a :class:`PendingGrad`
placeholder. A bucket whose size reaches ``bucket_mb`` is launched as one asynchronous
all-reduce while backward goes on; :meth:`GradBuckets.finish` launches the rest, waits and
replaces every placeholder by its reduced gradient. A compiled step's graph is bucketed by
the same policy (functional_pp/parallel/buckets/graph.py). Each element is summed exactly as the
per-parameter all-reduce sums it (same dtypes, same reduce dtype), so results are unchanged.

An op that touches a placeholder before :meth:`~GradBuckets.finish` (autograd adding two
contributions to one parameter) launches its bucket early and waits: correct, less overlap.
A pure dtype cast stays lazy (mixed precision casts the gradient back to the fp32 master).

Mechanism: Gradient buckets (bucketed asynchronous all-reduce; eager).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from functional_pp._torch import is_tracing
from functional_pp.core import comm
from functional_pp.core.runtime import current_context
from functional_pp.parallel.buckets import bucket_capacity
from functional_pp.parallel.buckets.pending import PendingGrad, Slot, resolve_pending
from functional_pp.parallel.collectives import _group, _reduce_dtype, set_gradient_sink


class _Bucket:
    """Gradients of one (group, axes, dtype) concatenated into one all-reduce."""

    def __init__(self, ctx, axes: tuple[str, ...], group: tuple[int, ...], device: torch.device):
        self.ctx, self.axes, self.group, self.device = ctx, axes, group, device
        self.parts: list[torch.Tensor] | None = []
        self.nbytes = 0
        self._wait: Callable[[], torch.Tensor] | None = None
        self.flat: torch.Tensor | None = None

    def append(self, g: torch.Tensor) -> tuple[int, int]:
        offset = sum(p.numel() for p in self.parts)
        self.parts.append(g)
        self.nbytes += g.numel() * g.element_size()
        return offset, g.numel()

    @property
    def launched(self) -> bool:
        return self.parts is None

    def launch(self) -> None:
        flat = torch.cat([p.reshape(-1) for p in self.parts])
        self.parts = None
        # recorded as a backward collective even when the last bucket is launched after
        # autograd returned: it is the transpose of the forward's pvary
        with comm.recording("all_reduce", self.axes, len(self.group), flat, backward=True):
            self._wait = start_all_reduce(self.ctx.backend, flat, self.group)

    def result(self) -> torch.Tensor:
        if not self.launched:
            self.launch()
        if self.flat is None:
            self.flat = self._wait()
            self._wait = None
        return self.flat


def start_all_reduce(backend, flat: torch.Tensor, group: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    """Launch a sum all-reduce of ``flat`` and return a function that waits for the result.
    Backends without asynchronous collectives (simulated devices) reduce at once."""
    start = getattr(backend, "start_all_reduce", None)
    if start is not None:
        return start(flat, group)
    out = backend.all_reduce(flat, "sum", group)
    return lambda: out


class GradBuckets:
    """The open and launched buckets of one backward pass on this device."""

    def __init__(self, bucket_mb: float):
        self.capacity = bucket_capacity(bucket_mb)     # the policy compiled steps share
        self.open: dict[tuple, _Bucket] = {}
        self.buckets: list[_Bucket] = []

    def add(self, g: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Queue the local gradient ``g`` for a sum over ``axes``; returns its placeholder."""
        ctx, axes, group = _group(axes, "psum")
        if len(group) == 1:
            return g
        wide = _reduce_dtype(g)
        y = g.to(wide) if wide else g
        key = (axes, group, y.dtype, y.device)
        bucket = self.open.get(key)
        # (a bucket is launched early when one of its placeholders is read during backward, e.g.
        # summed with another gradient of a parameter used twice: the next gradient opens a new one)
        if bucket is None or bucket.launched:
            bucket = self.open[key] = _Bucket(ctx, axes, group, y.device)
            self.buckets.append(bucket)
        offset, numel = bucket.append(y)
        slot = Slot(bucket, offset, numel, g.shape, g.dtype)
        if bucket.nbytes >= self.capacity:
            del self.open[key]
            bucket.launch()
        return PendingGrad(slot)

    def finish(self, grads: Sequence[Any]) -> list[Any]:
        """Launch the buckets still open (in the order they were opened, the same on every
        device), wait for all, and return ``grads`` with every placeholder resolved."""
        for bucket in self.buckets:
            if not bucket.launched:
                bucket.launch()
        self.open.clear()
        out = resolve_pending(grads)
        self.buckets = []          # release the flat buffers
        return out


@contextmanager
def grad_buckets(bucket_mb: float | None) -> Iterator[GradBuckets | None]:
    """Collect the data-parallel gradient all-reduces of the backward passes inside the block
    into buckets of ``bucket_mb`` megabytes (None: reduce every gradient at once, unbucketed).
    Call ``finish`` on the yielded object with the gradients before leaving the block."""
    if bucket_mb is None or is_tracing():
        yield None
        return
    buckets = GradBuckets(bucket_mb)
    ctx = current_context(required=False)
    set_gradient_sink(buckets.add, process_wide=ctx is not None and not ctx.simulated)
    try:
        yield buckets
    finally:
        set_gradient_sink(None)
