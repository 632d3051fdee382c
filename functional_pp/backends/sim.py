"""Simulated devices in one process: one thread per rank, collectives by rendezvous.

Every rank of a group deposits its tensor and waits until all have arrived; each then
computes the result from the same list in the same order, so results are bitwise equal on
all ranks. A failure on any rank aborts every pending and future rendezvous, so nothing hangs.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from functools import reduce

import torch

_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


class SimAborted(RuntimeError):
    """Raised on a simulated device because another device failed."""


class CollectiveTimeout(RuntimeError):
    pass


class SimWorld:
    """Shared state of a set of simulated devices."""

    def __init__(self, size: int, timeout: float = 300.0):
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: dict = {}
        self._seq = [defaultdict(int) for _ in range(size)]
        self.failure: tuple[int, BaseException] | None = None

    def abort(self, rank: int, exc: BaseException) -> None:
        with self._cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self._cond.notify_all()

    def exchange(self, rank: int, group: tuple[int, ...], payload, meta: tuple) -> list:
        """Give ``payload`` to the group and return every member's payload in group order.
        ``meta`` (collective kind and arguments) must agree across the group."""
        n = len(group)
        idx = group.index(rank)
        seq = self._seq[rank][group]
        self._seq[rank][group] = seq + 1
        key = (group, seq)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = {"data": [None] * n, "meta": [None] * n, "arrived": 0, "left": 0}
            slot["data"][idx] = payload
            slot["meta"][idx] = meta
            slot["arrived"] += 1
            self._cond.notify_all()
            while slot["arrived"] < n:
                if self.failure is not None:
                    raise SimAborted(f"device {self.failure[0]} failed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [group[i] for i, m in enumerate(slot["meta"]) if m is None]
                    err = CollectiveTimeout(
                        f"collective {meta[0]} #{seq} over ranks {group} timed out after "
                        f"{self.timeout:.0f}s: ranks {missing} never reached it (did the devices "
                        f"run different code?)")
                    self.failure = self.failure or (rank, err)
                    self._cond.notify_all()
                    raise err
                self._cond.wait(timeout=min(remaining, 1.0))
            if self.failure is not None and not isinstance(self.failure[1], SimAborted):
                pass  # the rendezvous completed; let the rank carry on to its next check
            metas = slot["meta"]
            slot["left"] += 1
            if slot["left"] == n:
                del self._slots[key]
            data = list(slot["data"])
        if any(m != metas[0] for m in metas):
            detail = "; ".join(f"rank {group[i]}: {m}" for i, m in enumerate(metas))
            raise RuntimeError(f"devices disagree on collective #{seq} over ranks {group}: {detail}")
        return data


class SimBackend:
    """Backend of one simulated rank."""

    name = "simulated"

    def __init__(self, world: SimWorld, rank: int):
        self.world = world
        self.rank = rank

    def _meta(self, kind: str, x: torch.Tensor, *args) -> tuple:
        return (kind, tuple(x.shape), str(x.dtype)) + args

    def all_reduce(self, x: torch.Tensor, op: str, group: tuple[int, ...]) -> torch.Tensor:
        data = self.world.exchange(self.rank, group, x, self._meta("all_reduce", x, op))
        return reduce(_REDUCE[op], data).clone() if len(data) == 1 else reduce(_REDUCE[op], data)

    def all_gather(self, x: torch.Tensor, dim: int, group: tuple[int, ...]) -> torch.Tensor:
        data = self.world.exchange(self.rank, group, x, self._meta("all_gather", x, dim))
        return torch.cat(data, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int, group: tuple[int, ...], op: str = "sum") -> torch.Tensor:
        data = self.world.exchange(self.rank, group, x, self._meta("reduce_scatter", x, dim, op))
        idx = group.index(self.rank)
        parts = [t.chunk(len(group), dim=dim)[idx] for t in data]
        return reduce(_REDUCE[op], parts).contiguous().clone()

    def all_to_all(self, x: torch.Tensor, split_dim: int, concat_dim: int, group: tuple[int, ...]) -> torch.Tensor:
        data = self.world.exchange(self.rank, group, x, self._meta("all_to_all", x, split_dim, concat_dim))
        idx = group.index(self.rank)
        return torch.cat([t.chunk(len(group), dim=split_dim)[idx] for t in data], dim=concat_dim)

    def permute(self, x: torch.Tensor, pairs: tuple[tuple[int, int], ...], group: tuple[int, ...]) -> torch.Tensor:
        data = self.world.exchange(self.rank, group, x, self._meta("permute", x, pairs))
        idx = group.index(self.rank)
        for src, dst in pairs:
            if dst == idx:
                return data[src].clone()
        return torch.zeros_like(x)

    def exchange_objects(self, obj, group: tuple[int, ...]) -> list:
        """Non-tensor exchange for checks (not counted as communication)."""
        return self.world.exchange(self.rank, group, obj, ("exchange_objects",))
