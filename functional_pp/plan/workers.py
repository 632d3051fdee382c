"""Evaluate a planner's candidates in worker processes: the dry-runs of different layouts are
independent, so ``jobs`` forked processes each run some and send back their estimates
(docs/planning.md, "Speed").

Workers are forked (they inherit the loss function, the parameter declarations and the cost
model, which need not pickle); only the candidates and the estimates cross the pipe. Where
``fork`` does not exist (Windows, or a caller that asked for one job) everything runs in this
process, in the same order, with the same results."""
from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable, Sequence

_work: dict[int, Callable[[Any], Any]] = {}     # pool token -> the function its workers run


def default_jobs() -> int:
    """The cores this process may use (``os.sched_getaffinity`` where it exists)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:          # (not Linux)
        return max(1, os.cpu_count() or 1)


def _child_init() -> None:
    import torch
    torch.set_num_threads(1)        # as DataLoader's workers: no intra-op pool after a fork


def _child_run(args: tuple[int, Any]) -> Any:
    token, item = args
    return _work[token](item)


class Pool:
    """``pool.map(items)``: ``fn`` of each item, in order, on ``jobs`` forked workers (started
    at the first map of more than one item, closed by :meth:`close` or the ``with`` block)."""

    def __init__(self, fn: Callable[[Any], Any], jobs: int | None = None) -> None:
        self.fn = fn
        self.jobs = default_jobs() if jobs is None else int(jobs)
        if self.jobs < 1:
            raise ValueError(f"plan: jobs={jobs!r}: give 1 or more worker processes (1 runs in this process)")
        if "fork" not in multiprocessing.get_all_start_methods():
            self.jobs = 1
        self._pool = None
        self._token = id(self)

    def map(self, items: Sequence[Any], done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """``[fn(x) for x in items]``; ``done(i, result)`` as each result arrives, in order."""
        items = list(items)
        if self.jobs == 1 or len(items) < 2:
            out = []
            for i, x in enumerate(items):
                out.append(self.fn(x))
                if done is not None:
                    done(i, out[-1])
            return out
        if self._pool is None:
            _work[self._token] = self.fn
            self._pool = multiprocessing.get_context("fork").Pool(self.jobs, initializer=_child_init)
        out = []
        for i, r in enumerate(self._pool.imap(_child_run, [(self._token, x) for x in items])):
            out.append(r)
            if done is not None:
                done(i, r)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
        _work.pop(self._token, None)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
