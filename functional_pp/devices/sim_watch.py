"""Hang detection for simulated devices (docs/bad_inputs.md §4).

A device waiting in a collective fails at once when a device it waits for has already
returned from the launched function, and after ``timeout`` seconds in which *no* device made
progress: no collective arrived anywhere and no device outside a collective used CPU time. A
device that is merely slow or compiling uses CPU time, so it never trips the timeout; one
blocked outside a collective (a lock, a sleep, input()) does. Messages say where every device is.

Mechanism: Devices (threaded simulator: hang detection).
"""
from __future__ import annotations

import threading
import time


class CollectiveTimeout(RuntimeError):
    """Simulated devices made no progress for the launch's timeout (says where each one is)."""


class DeviceFinishedError(RuntimeError):
    """A device waits in a collective for a device that already returned from its function."""


def _cpu_seconds(ident: int | None) -> float | None:
    """CPU time of the thread ``ident`` (None where the platform cannot tell)."""
    if ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, ValueError, OverflowError):
        return None


class Watch:
    """Where every simulated device is, and when anything last moved. Methods other than
    :meth:`started` are called with the world's lock held."""

    CPU_EPSILON = 0.05     # seconds of CPU time that count as progress
    CPU_LOOK_EVERY = 0.25  # seconds between two reads of the threads' CPU clocks (a syscall each)

    def __init__(self, size: int, timeout: float):
        self.size, self.timeout = size, timeout
        self.threads: dict[int, int] = {}
        self.waiting: dict[int, tuple[str, int, tuple[int, ...], float]] = {}
        self.last_done: dict[int, str] = {}
        self.finished: set[int] = set()
        self.cpu: dict[int, float] = {}
        self.last_progress = time.monotonic()
        self._process = (time.monotonic(), time.process_time())
        self._last_look = 0.0

    def started(self, rank: int) -> None:
        """Called on the device's own thread when it starts."""
        self.threads[rank] = threading.get_ident()

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def enter(self, rank: int, kind: str, seq: int, group: tuple[int, ...]) -> None:
        self.last_progress = now = time.monotonic()
        self.waiting[rank] = (kind, seq, group, now)

    def leave_all(self, ranks) -> None:
        """The collective that ``ranks`` wait in is complete."""
        for rank in ranks:
            kind, seq, _, _ = self.waiting.pop(rank, ("?", -1, (), 0.0))
            self.last_done[rank] = (kind, seq)
            self.cpu.pop(rank, None)
        self.progress()

    def finish(self, rank: int) -> None:
        self.finished.add(rank)
        self.progress()

    def check(self, rank: int, kind: str, seq: int, group: tuple[int, ...], missing: list[int]) -> None:
        """Raise if the collective ``rank`` waits in can never complete, or nothing moved for
        ``timeout`` seconds."""
        gone = [r for r in missing if r in self.finished]
        if gone:
            raise DeviceFinishedError(
                f"device {rank} waits in collective {kind} #{seq} over devices {group}, but device"
                f"{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} already returned from "
                f"the launched function; every device of a group must run the same collectives "
                f"(a return or break taken on some devices only?). Where the devices are:\n"
                + self.describe())
        now = time.monotonic()
        if now - self._last_look >= self.CPU_LOOK_EVERY:   # waiters check often: look at most this often
            self._last_look = now
            if self._cpu_moved():
                self.progress()
        idle = time.monotonic() - self.last_progress
        if idle >= self.timeout:
            raise CollectiveTimeout(
                f"simulated devices made no progress for {idle:.0f}s (launch timeout "
                f"{self.timeout:.0f}s): device {rank} waits in collective {kind} #{seq} over devices "
                f"{group} for devices {missing}. Where the devices are:\n" + self.describe()
                + "\nA device blocked outside a collective (a lock, a sleep, input()) or running "
                  "different collectives never arrives; raise launch(timeout=...) if it is "
                  "legitimately this slow")

    def _cpu_moved(self) -> bool:
        """Whether a device outside a collective used CPU time since the last look (or, where
        per-thread clocks are missing or work runs on helper threads, the process used more
        than 5% of a core: waiting devices use far less)."""
        wall, cpu = time.monotonic(), time.process_time()
        busy = False
        if wall - self._process[0] >= 0.5:          # judge the process over windows >= 0.5 s only
            busy = cpu - self._process[1] >= 0.05 * (wall - self._process[0])
            self._process = (wall, cpu)
        moved = busy
        for r, ident in list(self.threads.items()):   # a device may be starting
            if r in self.waiting or r in self.finished:
                continue
            now = _cpu_seconds(ident)
            if now is None:
                continue
            before = self.cpu.get(r)
            if before is None or now - before >= self.CPU_EPSILON:
                self.cpu[r] = now
                moved = moved or before is not None
        return moved

    def describe(self) -> str:
        """One line per device: finished, waiting in which collective, or running."""
        now = time.monotonic()
        lines = []
        for r in range(self.size):
            if r in self.finished:
                state = "returned from the launched function"
            elif r in self.waiting:
                kind, seq, group, since = self.waiting[r]
                state = f"waiting in {kind} #{seq} over devices {group} for {now - since:.0f}s"
            else:
                after = self.last_done.get(r)
                state = "running " + (f"(last collective: {after[0]} #{after[1]})" if after else "(no collective yet)")
            lines.append(f"  device {r}: {state}")
        return "\n".join(lines)
