"""The order of a training step's FSDP units, for forward prefetch (docs/communication.md,
"FSDP units", prefetch).

A forward gathers its units in the order the model calls its layers. :class:`UnitOrder`
records, per device, which parameters (their positions in the step's parameter tree) each
unit call gathered; the next forward of the same step reads that record to launch the
gather of call k+1 before call k computes, as FSDP2 prefetches the next module. A record
that no longer matches (the model called other layers) only costs the wasted prefetch: the
unit is gathered at once instead. :func:`trace_units` records when each unit's gather was
launched and awaited and when its layer computed, for tests and benchmarks.

Mechanism: FSDP (the units' forward order, for prefetch; eager).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Hashable, Iterator

from functional_pp.core.runtime import new_per_thread, per_thread

# one unit call: per group of mesh axes and dtype, (axes, dtype, parameter positions, dims)
Signature = tuple[Hashable, ...]

_trace = per_thread("parallel.fsdp.order.trace")


class UnitOrder:
    """Per device thread (simulated devices share one step): the unit calls of the last
    forward and of the one running."""

    def __init__(self) -> None:
        self._local = new_per_thread()

    def begin(self) -> None:
        """A forward starts: the calls recorded so far become the ones to replay."""
        current = getattr(self._local, "current", None)
        if current:
            self._local.last = current
        self._local.current = []

    def record(self, signature: Signature | None) -> int:
        """Record the next unit call of this forward (None: not replayable); its index."""
        current = self._local.__dict__.setdefault("current", [])
        current.append(signature)
        return len(current) - 1

    def expected(self, call: int) -> Signature | None:
        """The signature of unit call ``call`` in the last forward, or None."""
        last = getattr(self._local, "last", [])
        return last[call] if 0 <= call < len(last) else None


@contextmanager
def trace_units() -> Iterator[list[tuple[str, int]]]:
    """Inside the block, this thread's FSDP unit events in order: ``("launch", k)`` (call k's
    flat all-gather issued), ``("wait", k)`` (its result awaited), ``("compute", k)`` (its
    layer starts computing); in backward ``("backward", k)`` (its re-gathered weights first
    needed), ``("reduce_scatter", k)`` / ``("reduce_scatter_wait", k)`` (its gradients'
    asynchronous reduce-scatter issued / awaited)."""
    events: list[tuple[str, int]] = []
    previous = getattr(_trace, "events", None)
    _trace.events = events
    try:
        yield events
    finally:
        _trace.events = previous


def trace(what: str, call: int) -> None:
    """Add an event to the active :func:`trace_units` list of this thread, if any."""
    events = getattr(_trace, "events", None)
    if events is not None:
        events.append((what, call))
