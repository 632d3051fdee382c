"""Peak memory of a block of code on this thread, from the profiler's allocator events
(CPU has no allocator statistics). Only one thread of a process may measure at a time."""
from __future__ import annotations

from contextlib import contextmanager

import torch


class Peak:
    bytes: int = 0


class Windows:
    """The blocks measured in one profiler session (:func:`window_peaks`)."""

    def __init__(self):
        self.peaks: list[int] = []
        self.retained: list[int] = []
        self._count = 0

    @property
    def count(self) -> int:
        """How many windows were opened so far (the next window's index)."""
        return self._count

    @contextmanager
    def window(self):
        """Mark a block whose peak is measured: ``with w.window(): ...``."""
        with torch.profiler.record_function(f"memtrack_window_{self._count}"):
            self._count += 1
            yield


@contextmanager
def window_peaks():
    """Several blocks' peaks from ONE profiler session: ``with window_peaks() as w:`` around all
    of them, ``with w.window(): ...`` around each; afterwards ``w.peaks[i]`` is the largest amount
    of memory allocated at once inside the i-th window beyond what was allocated when it began,
    and ``w.retained[i]`` what the window left allocated at its end (e.g. a forward pass: the
    activations kept for backward, with the result).

    A process with other threads doing torch work (gloo's worker threads finish a collective
    after its waiter has returned) starts and stops the profiler once this way instead of once
    per block: stopping it while another thread still reports allocations to it can crash the
    process: one of the 4 gloo processes tests/compile/test_compiled_zero3_memory.py then used died with SIGSEGV
    right after a stop once in CI, and 11 stress runs of 40 stops per process left a rank stuck
    outside any collective once (the same class of race as pytorch/pytorch#132331). Fewer stops,
    each after the measured work, narrow that window."""
    w = Windows()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        yield w
    events = list(prof.profiler.kineto_results.events())
    marks = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), int(e.name().rsplit("_", 1)[1]))
                   for e in events if e.name().startswith("memtrack_window_"))
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    peaks, retained = [0] * w._count, [0] * w._count
    current, i = 0, 0
    for start, end, k in marks:
        while i < len(memory) and memory[i][0] < start:
            current += memory[i][1]
            i += 1
        base = peak = current
        while i < len(memory) and memory[i][0] <= end:
            current += memory[i][1]
            peak = max(peak, current)
            i += 1
        peaks[k] = peak - base
        retained[k] = current - base
    w.peaks, w.retained = peaks, retained


@contextmanager
def peak_memory():
    """``with peak_memory() as p: ...``; then ``p.bytes`` is the largest amount of memory
    allocated at once inside the block beyond what was allocated before it (one window of
    :func:`window_peaks`)."""
    result = Peak()
    with window_peaks() as w:
        with w.window():
            yield result
    result.bytes = w.peaks[0]
