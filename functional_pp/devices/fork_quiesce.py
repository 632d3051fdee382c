"""Forking from a process with other threads (``launch(processes=True)``, docs/real_processes.md).

A forked child holds a copy of every lock of its parent, in whatever state the parent's other
threads left it, and none of those threads: a lock one of them held at the fork (MKL's allocator
while it computed or freed a thread's buffers, an allocator mid-update) stays held in the child
for ever (a hang), or the structure it guarded is half-written there (an abort). A thread that
sleeps (blocked in a wait, a read, a poll) holds no such lock while it sleeps; one that runs
native code (state R in ``/proc``, also when only waiting for a CPU on a loaded machine) or sits
in uninterruptible I/O (D) may. :func:`quiesce_before_fork` waits until every other thread of the
process sleeps, bounded; the parent forks right after it.
"""
from __future__ import annotations

import os
import threading
import time

__all__ = ["busy_threads", "quiesce_before_fork", "QUIESCE_LIMIT"]

QUIESCE_LIMIT = 10.0      # seconds a fork waits for the other threads to sleep
_BUSY = ("R", "D")        # running or runnable; uninterruptible I/O


def busy_threads() -> list[int]:
    """Native ids of this process's threads, other than the caller, that run or wait for a CPU
    (or sit in uninterruptible I/O) now, from ``/proc/self/task`` ([] where there is none)."""
    me = threading.get_native_id()
    busy = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for task in tasks:
        if int(task) == me:
            continue
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue                         # a thread that ended while being read
        if state in _BUSY:
            busy.append(int(task))
    return busy


def quiesce_before_fork(limit: float = QUIESCE_LIMIT, poll: float = 0.001) -> list[int]:
    """Wait until no other thread of this process is busy (:func:`busy_threads`) in two looks
    ``poll`` seconds apart (a thread that only waited for the GIL runs again in between), at
    most ``limit`` seconds. Returns the threads still busy then ([] once quiet)."""
    deadline = time.monotonic() + limit
    quiet_once = False
    while True:
        busy = busy_threads()
        if not busy:
            if quiet_once:
                return []
            quiet_once = True
        else:
            quiet_once = False
            if time.monotonic() >= deadline:
                return busy
        time.sleep(poll)
