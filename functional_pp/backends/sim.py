"""Simulated devices in one process: one thread per rank, collectives by rendezvous.

Every rank of a group deposits its tensor and waits until all have arrived; each then
computes the result from the same list in the same order, so results are bitwise equal on
all ranks. A failure on any rank aborts every pending and future rendezvous, so nothing hangs.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from functools import reduce

import torch

from .sim_watch import CollectiveTimeout, DeviceFinishedError, Watch  # noqa: F401 (re-exported)

_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


class SimAborted(RuntimeError):
    """Raised on a simulated device because another device failed."""




class SimWorld:
    """Shared state of a set of simulated devices."""

    def __init__(self, size: int, timeout: float = 300.0):
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: dict = {}
        self._seq = [defaultdict(int) for _ in range(size)]
        self.failure: tuple[int, BaseException] | None = None
        self.watch = Watch(size, timeout)    # early returns, no-progress timeout

    def finish(self, rank: int) -> None:
        """``rank`` returned from the launched function: collectives waiting for it fail."""
        with self._cond:
            self.watch.finish(rank)
            self._cond.notify_all()

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
        with self._cond:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = {"data": [None] * n, "meta": [None] * n, "arrived": 0, "left": 0}
            slot["data"][idx] = payload
            slot["meta"][idx] = meta
            slot["arrived"] += 1
            self.watch.enter(rank, meta[0], seq, group)
            self._cond.notify_all()
            while slot["arrived"] < n:
                if self.failure is not None:
                    raise SimAborted(f"device {self.failure[0]} failed")
                missing = [group[i] for i, m in enumerate(slot["meta"]) if m is None]
                try:
                    self.watch.check(rank, meta[0], seq, group, missing)
                except (CollectiveTimeout, DeviceFinishedError) as err:
                    self.failure = self.failure or (rank, err)
                    self._cond.notify_all()
                    raise
                self._cond.wait(timeout=min(self.timeout, 1.0))
            self.watch.leave(rank)
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


_WORLDS: dict[int, SimWorld] = {}


def _register(world: SimWorld) -> int:
    key = id(world)
    _WORLDS[key] = world
    return key


def _unregister(world: SimWorld) -> None:
    _WORLDS.pop(id(world), None)


def _compute(kind: str, data: list, idx: int, n: int, args: list[int]) -> torch.Tensor:
    if kind in ("all_reduce_sum", "all_reduce_max", "all_reduce_min"):
        out = reduce(_REDUCE[kind.rsplit("_", 1)[1]], data)
        return out.clone() if n == 1 else out
    if kind == "all_gather":
        return torch.cat(data, dim=args[0])
    if kind == "reduce_scatter":
        parts = [t.chunk(n, dim=args[0])[idx] for t in data]
        return reduce(torch.add, parts).contiguous().clone()
    if kind == "all_to_all":
        return torch.cat([t.chunk(n, dim=args[0])[idx] for t in data], dim=args[1])
    if kind == "permute":   # args: flattened (src, dst) pairs
        for src, dst in zip(args[0::2], args[1::2]):
            if dst == idx:
                return data[src].clone()
        return torch.zeros_like(data[idx])
    raise ValueError(kind)


@torch.library.custom_op("fpp_sim::collective", mutates_args=())
def _sim_collective(x: torch.Tensor, kind: str, group: list[int], rank: int, world: int,
                    args: list[int]) -> torch.Tensor:
    """One simulated collective (an opaque op, so torch.compile traces it)."""
    w = _WORLDS[world]
    group = tuple(group)
    data = w.exchange(rank, group, x, (kind, tuple(x.shape), str(x.dtype), tuple(args)))
    return _compute(kind, data, group.index(rank), len(group), list(args))


@_sim_collective.register_fake
def _(x, kind, group, rank, world, args):
    n = len(group)
    shape = list(x.shape)
    if kind == "all_gather":
        shape[args[0]] *= n
    elif kind == "reduce_scatter":
        shape[args[0]] //= n
    elif kind == "all_to_all":
        shape[args[0]] //= n
        shape[args[1]] *= n
    return x.new_empty(shape)


class SimBackend:
    """Backend of one simulated rank."""

    name = "simulated"

    def __init__(self, world: SimWorld, rank: int):
        self.world = world
        self.rank = rank
        self._key = _register(world)

    def _op(self, x, kind, group, args=()):
        return torch.ops.fpp_sim.collective(x, kind, list(group), self.rank, self._key, list(args))

    def all_reduce(self, x: torch.Tensor, op: str, group: tuple[int, ...]) -> torch.Tensor:
        return self._op(x, f"all_reduce_{op}", group)

    def all_gather(self, x: torch.Tensor, dim: int, group: tuple[int, ...]) -> torch.Tensor:
        return self._op(x, "all_gather", group, (dim,))

    def reduce_scatter(self, x: torch.Tensor, dim: int, group: tuple[int, ...], op: str = "sum") -> torch.Tensor:
        return self._op(x, "reduce_scatter", group, (dim,))

    def all_to_all(self, x: torch.Tensor, split_dim: int, concat_dim: int, group: tuple[int, ...]) -> torch.Tensor:
        return self._op(x, "all_to_all", group, (split_dim, concat_dim))

    def permute(self, x: torch.Tensor, pairs: tuple[tuple[int, int], ...], group: tuple[int, ...]) -> torch.Tensor:
        return self._op(x, "permute", group, [i for pair in pairs for i in pair])

    def exchange_objects(self, obj, group: tuple[int, ...]) -> list:
        """Non-tensor exchange for checks (not counted as communication)."""
        return self.world.exchange(self.rank, group, obj, ("exchange_objects",))
