"""Peak memory of a block of code on this thread, from the profiler's allocator events
(CPU has no allocator statistics). Only one thread of a process may measure at a time."""
from __future__ import annotations

from contextlib import contextmanager

import torch


class Peak:
    bytes: int = 0


@contextmanager
def peak_memory():
    """``with peak_memory() as p: ...``; then ``p.bytes`` is the largest amount of memory
    allocated at once inside the block beyond what was allocated before it."""
    result = Peak()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    result.bytes = peak
