"""Faults of real processes (docs/bad_inputs.md §4): a killed or stalled rank is reported with
its rank, within the collective timeout, instead of a hang or a bare gloo message.

- :func:`supervise` (``launch(processes=True)``): the parent watches its children; a child that
  dies without reporting, or stays stopped (SIGSTOP) longer than the timeout, is named at once;
  children that all sit blocked without using CPU time for longer than the timeout plus a
  grace (a deadlock: no collective would wait that long) are named then.
- :func:`explain_comm_failure` (every rank, torchrun too): when a collective fails (gloo's
  timeout, a closed connection), the rank checks in through the rendezvous store and names
  the ranks that did not check in: stalled, dead or stuck elsewhere.
"""
from __future__ import annotations

import os
import queue as queue_mod
import signal
import time
from datetime import timedelta

DEFAULT_PROCESS_TIMEOUT = 600.0   # seconds a real collective may wait for a peer
IDLE_GRACE = 60.0                 # beyond the timeout: a timed-out collective's rank reports by then
_COMM_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
               "connection refused", "peer")


class CollectiveTimeoutError(RuntimeError):
    """A collective between real processes failed because a peer did not take part in time;
    names the ranks that did not answer."""


class RankDiedError(RuntimeError):
    """A rank's process ended without reporting a result (killed, crashed or stopped)."""


def process_state(pid: int) -> str:
    """The state letter of ``pid`` from ``/proc`` (R, S, T = stopped, Z, ...) or '?'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def describe_processes(procs: list, reported: set[int]) -> str:
    """One line per rank that has not reported: running, stopped or dead."""
    lines = []
    for r, p in enumerate(procs):
        if r in reported:
            continue
        if p.exitcode is not None:
            what = _exit_text(p.exitcode)
        else:
            what = {"T": "stopped (SIGSTOP?)", "t": "stopped by a debugger",
                    "Z": "exited (zombie)"}.get(process_state(p.pid), "running")
        lines.append(f"  rank {r} (pid {p.pid}): {what}")
    return "\n".join(lines)


#: threads of torch's process groups that poll on their own, blocked rank or not (gloo's TCP
#: loop wakes and uses CPU time while the rank's own threads wait forever)
_POLLING_THREADS = ("gloo_", "pt_gloo", "pt_tcpstore", "pt_nccl")


def _ticks(stat_path: str) -> int:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_ticks(pid: int) -> int | None:
    """User plus system CPU time of ``pid``'s own threads in clock ticks, from ``/proc``
    (None elsewhere): the process groups' polling threads are left out."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/comm") as f:
                    if f.read().startswith(_POLLING_THREADS):
                        continue
                total += _ticks(f"/proc/{pid}/task/{task}/stat")
            except (OSError, IndexError, ValueError):
                continue            # a thread that ended while being read
        return total
    except OSError:                 # no /proc (not Linux) or the process is gone
        return None


class IdleWatch:
    """Whether every unreported child has used no CPU time for ``limit`` seconds: blocked in a
    lock forever (one inherited held at fork), since a collective gives up after the timeout
    and its rank then reports."""

    def __init__(self, procs: list, limit: float):
        self.procs, self.limit = procs, limit
        self.ticks: dict[int, int | None] = {}
        self.since = time.monotonic()

    def idle_for(self, reported: set[int], now: float) -> float:
        ticks = {r: cpu_ticks(p.pid) for r, p in enumerate(self.procs) if r not in reported}
        if None in ticks.values() or ticks != self.ticks:
            self.ticks, self.since = ticks, now
        return now - self.since if ticks else 0.0


def supervise(procs: list, q, size: int, timeout: float, on_error) -> list:
    """Collect one ``(rank, ok, value, traceback)`` per process from ``q``; ``on_error(rank,
    message, tb)`` builds the exception raised for a failed or lost rank."""
    results: list = [None] * size
    reported: set[int] = set()
    stopped_since: dict[int, float] = {}
    exited_at: dict[int, float] = {}
    idle = IdleWatch(procs, timeout + IDLE_GRACE)
    while len(reported) < size:
        try:
            rank, ok, value, tb = q.get(timeout=0.5)
        except queue_mod.Empty:
            now = time.monotonic()
            waited = idle.idle_for(reported, now)
            if waited >= idle.limit:
                stuck = min(r for r in range(size) if r not in reported)
                raise on_error(stuck, RankDiedError(
                    f"no rank that has not reported used any CPU time for {waited:.0f}s (the "
                    f"collective timeout {timeout:.0f}s plus {IDLE_GRACE:.0f}s): the processes are "
                    f"blocked outside collectives, deadlocked (a lock held when they were forked?); "
                    f"they were stopped. Raise launch(timeout=...) if a rank legitimately sleeps "
                    f"that long. Processes:\n" + describe_processes(procs, reported)), "")
            for r, p in enumerate(procs):
                if r in reported:
                    continue
                if p.exitcode is not None and _lost(p, exited_at.setdefault(r, now), now):
                    raise on_error(r, RankDiedError(
                        f"the process of rank {r} (pid {p.pid}) {_exit_text(p.exitcode)} without "
                        f"reporting a result; the other ranks were stopped. Processes:\n"
                        + describe_processes(procs, reported)), "")
                if process_state(p.pid) in ("T", "t"):
                    since = stopped_since.setdefault(r, now)
                    if now - since >= timeout:
                        raise on_error(r, RankDiedError(
                            f"the process of rank {r} (pid {p.pid}) has been stopped for "
                            f"{now - since:.0f}s (SIGSTOP or a debugger; timeout {timeout:.0f}s); "
                            f"its peers wait for it in collectives. Processes:\n"
                            + describe_processes(procs, reported)), "")
                else:
                    stopped_since.pop(r, None)
            continue
        reported.add(rank)
        if not ok:
            time.sleep(0.5)            # let a dead peer's exit status arrive: it is the cause
            states = describe_processes(procs, reported)
            raise on_error(rank, _with_note(value, f"\nRanks that have not reported:\n{states}"
                                            if states else ""), tb)
        results[rank] = value
    return results


def _with_note(exc: BaseException | str, note: str) -> BaseException:
    """The exception a child reported, with ``note`` appended to its message when possible."""
    if isinstance(exc, str):
        return RuntimeError(exc + note)
    if not note:
        return exc
    try:
        return type(exc)(f"{exc}{note}")
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        return RuntimeError(f"{type(exc).__name__}: {exc}{note}")


def _lost(p, exited_at: float, now: float) -> bool:
    """A process that ended without reporting: at once when killed or failed; after a few
    seconds' grace when it exited normally (its result may still be in the queue's pipe)."""
    return p.exitcode != 0 or now - exited_at > 5.0


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed for lack of a peer."""
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, OSError)) and any(w in text for w in _COMM_WORDS)


def explain_comm_failure(exc: BaseException, rank: int, world: int, timeout: float,
                         wait: float = 10.0) -> CollectiveTimeoutError:
    """A :class:`CollectiveTimeoutError` for ``exc`` naming the ranks that do not check in
    through the rendezvous store within ``wait`` seconds."""
    import torch.distributed as dist
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    missing: list[int] | None = None
    note = ""
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=wait),
                              wait_for_workers=False)
        store.set(f"fpp/alive/{rank}", "1")
        deadline = time.monotonic() + wait
        while True:
            missing = [r for r in range(world) if not store.check([f"fpp/alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception as store_exc:  # noqa: BLE001 - the store's host may be the stalled rank
        note = (f" The rendezvous store at {host}:{port} does not answer either ({store_exc}); "
                f"the rank hosting it (rank 0 for processes=True) may be the stalled one.")
    who = (f"ranks {missing} did not check in within {wait:.0f}s: stalled (SIGSTOP), dead or "
           f"stuck outside collectives" if missing else
           "every rank checked in afterwards (a transient network failure?)" if missing == [] else
           "could not tell which rank is missing.")
    return CollectiveTimeoutError(
        f"rank {rank}: a collective failed after waiting up to the collective timeout "
        f"({timeout:.0f}s): {exc}. {who}.{note} Raise collective_timeout (launch(timeout=...)) "
        f"if a rank legitimately works that long between collectives")
