"""Turns for simulated devices: at most ``limit`` device threads run at once (docs/simulation.md).

Simulated devices are threads of one process, so CPython's global interpreter lock lets only
one of them run Python at a time anyway. When many can run, every torch op (which releases
the lock) wakes a waiting thread on another core that mostly finds the lock taken again: on
an idle 2-core machine 16 devices then spent about 3x the CPU time of the same devices taking
turns. A device gives its turn up while it sleeps in a collective (or waits for a compilation)
and takes one before running again; turns go to waiting devices first come, first served.

A device that holds a turn but is blocked outside any collective (a barrier of its own, a
sleep, a lock) would keep the others waiting: a device waiting for a turn looks every
``patience`` seconds at the devices holding one, and runs without a turn when, at two looks
in a row, none of them used CPU time since the look before and none is runnable (Linux
thread state; a runnable thread that the OS has not scheduled on a busy machine is not
blocked), and after ``give_up`` seconds of waiting
in any case (a holder spinning while it waits for another device cannot hold the others up
for longer). Turns never decide what runs, only when.

Mechanism: Devices (threaded simulator: turns).
"""
from __future__ import annotations

import threading
import time
from collections import deque

from functional_pp.devices.sim_watch import _cpu_seconds


def _thread_state(native_id: int | None) -> str | None:
    """The Linux state letter of a thread of this process (R runnable, S sleeping, ...)."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            stat = f.read()
        return chr(stat[stat.rindex(b")") + 2])
    except (OSError, ValueError, IndexError):
        return None


class Turns:
    """At most ``limit`` of ``size`` devices hold a turn; :meth:`take` waits for one (first
    come, first served, handed over directly by :meth:`give`)."""

    PATIENCE = 0.02    # seconds between two looks at the turn holders
    GIVE_UP = 2.0      # seconds after which a waiting device runs without a turn in any case

    def __init__(self, size: int, limit: int = 1, patience: float | None = None, give_up: float | None = None):
        self.limit = limit
        self.patience = self.PATIENCE if patience is None else patience
        self.give_up = self.GIVE_UP if give_up is None else give_up
        self._lock = threading.Lock()
        self._free = limit
        self._queue: deque[int] = deque()
        self._holding = [False] * size
        self._threads: list[int | None] = [None] * size
        self._native: list[int | None] = [None] * size
        self._wake = [threading.Lock() for _ in range(size)]
        for lock in self._wake:
            lock.acquire()                   # held: a waiting device blocks on its own lock

    def take(self, rank: int) -> None:
        """Wait for a turn for ``rank`` (running on its own thread)."""
        self._threads[rank] = threading.get_ident()
        self._native[rank] = threading.get_native_id()
        with self._lock:
            if self._holding[rank]:
                return
            if self._free > 0:
                self._free -= 1
                self._holding[rank] = True
                return
            self._queue.append(rank)
        wake = self._wake[rank]
        seen = self._holders_cpu()
        since, idle_looks = time.monotonic(), 0
        while not wake.acquire(timeout=self.patience):
            with self._lock:
                if rank not in self._queue:          # handed a turn just after the timeout
                    wake.acquire(blocking=False)
                    return
                now = self._holders_cpu()
                idle_looks = idle_looks + 1 if now is None or (now == seen and not self._holder_runnable()) else 0
                if idle_looks >= 2 or time.monotonic() - since > self.give_up:
                    # the holders are blocked (or busy for long): run without a turn
                    self._queue.remove(rank)
                    return
                seen = now

    def give(self, rank: int) -> None:
        """``rank`` stops running for now (sleeps, waits, returns): its turn goes to the device
        that has waited longest."""
        with self._lock:
            if not self._holding[rank]:
                return
            self._holding[rank] = False
            if self._queue:
                nxt = self._queue.popleft()
                self._holding[nxt] = True
                self._wake[nxt].release()
            else:
                self._free += 1

    def _holder_runnable(self) -> bool:
        """Whether a device holding a turn is runnable (or its state is unknown)."""
        for r, holding in enumerate(self._holding):
            if holding and _thread_state(self._native[r]) in ("R", None):
                return True
        return False

    def _holders_cpu(self) -> tuple | None:
        """CPU seconds of the devices holding a turn, rounded to 1 ms (None: unknown)."""
        seconds = []
        for r, holding in enumerate(self._holding):
            if holding:
                cpu = _cpu_seconds(self._threads[r])
                if cpu is None:
                    return None
                seconds.append(round(cpu, 3))
        return tuple(seconds)
