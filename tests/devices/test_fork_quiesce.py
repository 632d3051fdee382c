"""``launch(processes=True)`` forks only once the parent's other threads sleep
(functional_pp/devices/fork_quiesce.py): a thread running native code at the fork can leave the
child a lock held (a hang) or a structure half-written (an abort in the child)."""
from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

import functional_pp as fpp
from functional_pp.devices import fork_quiesce, launch

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread states are read from /proc (Linux)")


class _NativeWork(threading.Thread):
    """One long call into C without the GIL (a hash of ``mb`` MB): the thread runs (state R)
    until it returns; ``done_at`` is the monotonic time it returned."""

    def __init__(self, mb: int):
        super().__init__(daemon=True)
        self.data, self.started, self.done_at = b"\0" * (mb << 20), threading.Event(), None

    def run(self):
        self.started.set()
        hashlib.sha256(self.data).digest()
        self.done_at = time.monotonic()


def test_a_busy_thread_is_named_when_it_outlasts_the_bound():
    work = _NativeWork(mb=200)
    work.start()
    work.started.wait()
    busy = fork_quiesce.quiesce_before_fork(limit=0.02)
    assert work.native_id in busy, (busy, work.done_at)
    work.join()
    assert fork_quiesce.quiesce_before_fork(limit=5) == []


def test_processes_are_forked_after_the_parents_native_work_ends():
    work = _NativeWork(mb=100)
    work.start()
    work.started.wait()
    forked_at = fpp.launch(time.monotonic, fpp.Mesh(), processes=True, timeout=120)[0]
    work.join()
    assert forked_at >= work.done_at, f"the child ran {work.done_at - forked_at:.3f}s before the parent's thread ended"


def test_a_thread_busy_past_the_bound_is_named_in_a_warning_and_the_launch_goes_on(monkeypatch):
    monkeypatch.setattr(launch, "QUIESCE_LIMIT", 0.02)
    work = _NativeWork(mb=200)
    work.start()
    work.started.wait()
    with pytest.warns(RuntimeWarning, match=rf"forking while thread\(s\) \[{work.native_id}\]"):
        assert fpp.launch(lambda: 7, fpp.Mesh(), processes=True, timeout=120) == [7]
    work.join()
