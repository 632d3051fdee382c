"""Simulated devices in one process: one thread per rank, collectives by rendezvous.

Every rank of a group deposits its tensor and waits; the last to arrive checks that all
agree on the collective, computes the shared part of the result once (the sum, the
concatenation) and wakes the others, who each take their own copy. Every rank therefore gets
a bitwise equal result at the cost of one reduction per group, not one per rank
(docs/simulation.md). A failure on any rank aborts every pending and future rendezvous, so
nothing hangs.

Mechanism: Devices (threaded simulator: a thread per rank, collectives by rendezvous).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable

import torch

from functional_pp._torch import runs_eagerly
from functional_pp.devices.sim_turns import Turns
from functional_pp.devices.sim_watch import CollectiveTimeout, DeviceFinishedError, Watch  # noqa: F401 (re-exported)


class SimAborted(RuntimeError):
    """Raised on a simulated device because another device failed."""


class SharedBackwardThread(RuntimeError):
    """A collective of a simulated device ran on a thread that is not the device's own, while a
    peer of its group may be queued on that same thread: autograd's device thread for CUDA
    tensors, shared by every simulated device on that GPU (docs/simulation.md, "On a GPU")."""


SHARED_THREAD_ADVICE = (
    "the threaded simulator cannot run a collective inside a backward pass on CUDA: autograd runs "
    "the backward of CUDA tensors on one thread per GPU, shared by every simulated device, so a "
    "device waiting there for its peers blocks the peers' own backward for ever. Run the devices "
    "as one batched computation instead (fpp.launch(fn, mesh, simulate=\"batched\"), building "
    "per-device inputs with fpp.per_device; --sim-mode batched on the command line), or keep the "
    "simulated devices' tensors on the CPU, or run one process per GPU under torchrun")


class _Slot:
    """One rendezvous in progress: what each member deposited, and the shared result."""

    __slots__ = ("data", "meta", "arrived", "waiters", "ready", "shared", "error")

    def __init__(self, n: int):
        self.data: list = [None] * n
        self.meta: list = [None] * n
        self.arrived = 0
        self.waiters: list[int] = []        # ranks asleep on this rendezvous
        self.ready = False
        self.shared: Any = None
        self.error: BaseException | None = None


def _asleep_lock() -> Any:
    """A device's wake-up call: a held lock that the device blocks on and another releases."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class SimWorld:
    """Shared state of a set of simulated devices.

    A device waiting in a collective sleeps on its own held lock (the cheapest blocking call
    in CPython: one futex, no condition variable, no shared lock to retake on waking); the
    device that completes the rendezvous, a failing device and a returning one release the
    sleepers they concern. ``_asleep`` (guarded by ``_lock``) holds the devices whose lock is
    held and that nobody has released yet, so each sleep is released exactly once
    (docs/simulation.md)."""

    POLL = 1.0      # seconds between two looks of a sleeping device at the watchdog
    RUNNING = 1     # devices that run at once (sim_turns.py; docs/simulation.md)

    def __init__(self, size: int, timeout: float = 300.0):
        self.size = size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._slots: dict = {}
        self._seq = [defaultdict(int) for _ in range(size)]
        self._wake = [_asleep_lock() for _ in range(size)]
        self._asleep: set[int] = set()
        self.failure: tuple[int, BaseException] | None = None
        self.watch = Watch(size, timeout)    # early returns, no-progress timeout
        self.turns = Turns(size, self.RUNNING)
        self._placed: list = [None] * size   # the device of each rank's last collective input

    def _release(self, ranks) -> None:
        """Wake the sleeping devices among ``ranks`` (lock held)."""
        for r in ranks:
            if r in self._asleep:
                self._asleep.discard(r)
                self._wake[r].release()

    def _wake_all(self) -> None:
        self._release(list(self._asleep))

    def start(self, rank: int) -> None:
        """``rank`` starts running the launched function (on its own thread)."""
        self.watch.started(rank)
        self.turns.take(rank)

    def finish(self, rank: int) -> None:
        """``rank`` returned from the launched function: collectives waiting for it fail."""
        self.turns.give(rank)
        with self._lock:
            self.watch.finish(rank)
            self._wake_all()

    def abort(self, rank: int, exc: BaseException) -> None:
        self.turns.give(rank)
        with self._lock:
            if self.failure is None:
                self.failure = (rank, exc)
            self._wake_all()

    def exchange(self, rank: int, group: tuple[int, ...], payload, meta: tuple) -> list:
        """Give ``payload`` to the group and return every member's payload in group order.
        ``meta`` (collective kind and arguments) must agree across the group."""
        return list(self.rendezvous(rank, group, payload, meta, list))

    def rendezvous(self, rank: int, group: tuple[int, ...], payload, meta: tuple,
                   combine: Callable[[list], Any]) -> Any:
        """Deposit ``payload`` and wait for the group. The last member to arrive checks that
        every ``meta`` (collective kind and arguments) agrees and computes
        ``combine(payloads in group order)`` once; every member gets that value (to read, not
        to modify). Payloads are read only while every member is still inside the rendezvous."""
        n = len(group)
        idx = group.index(rank)
        if n > 1:
            where = getattr(payload, "device", None)
            own = self.watch.threads.get(rank)     # (None: used without launch's start, in tests)
            if own is not None and threading.get_ident() != own:
                self._refuse_shared_thread(rank, group, meta[0], where)
            self._placed[rank] = where
        seqs = self._seq[rank]
        seq = seqs[group]
        seqs[group] = seq + 1
        key = (group, seq)
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(n)
            slot.data[idx] = payload
            slot.meta[idx] = meta
            slot.arrived += 1
            self.watch.enter(rank, meta[0], seq, group)
            owner = slot.arrived == n
            if owner:
                del self._slots[key]           # complete: every member holds the slot itself
            else:
                slot.waiters.append(rank)
                self._asleep.add(rank)
        if owner:                      # compute outside the lock: others may enter other groups
            try:
                metas = slot.meta
                if any(m != metas[0] for m in metas):
                    detail = "; ".join(f"rank {group[i]}: {m}" for i, m in enumerate(metas))
                    raise RuntimeError(f"devices disagree on collective #{seq} over ranks {group}: {detail}")
                shared, error = combine(slot.data), None
            except Exception as exc:  # noqa: BLE001 - every member raises it
                shared, error = None, exc
            with self._lock:
                slot.shared, slot.error, slot.ready, slot.data = shared, error, True, None
                self.watch.leave_all(group)
                self._release(slot.waiters)
        else:
            self.turns.give(rank)              # another device runs while this one sleeps
            self._wait(slot, rank, meta[0], seq, group)
            self.turns.take(rank)
        if slot.error is not None:
            raise _own_copy(slot.error) from slot.error
        return slot.shared

    def _refuse_shared_thread(self, rank: int, group: tuple[int, ...], kind: str, where) -> None:
        """Raise :class:`SharedBackwardThread` for a collective of ``rank`` on a thread other than
        its own (autograd's device thread: the backward of CUDA tensors), unless every peer of
        the group is known to hold its tensors on another device than ``where`` (one GPU per
        simulated device: each has an autograd thread of its own, and nothing waits in vain)."""
        peers = [self._placed[r] for r in group if r != rank]
        if where is not None and all(p is not None and p != where for p in peers):
            return
        raise SharedBackwardThread(
            f"device {rank}: collective {kind} over devices {group} runs on thread "
            f"{threading.current_thread().name!r}, not on the device's own thread (on "
            f"{where if where is not None else 'an unknown device'}): " + SHARED_THREAD_ADVICE)

    def _wait(self, slot: _Slot, rank: int, kind: str, seq: int, group: tuple[int, ...]) -> None:
        """Sleep until ``slot`` is ready; raise if another device failed, a member already
        returned, or nothing progressed for the timeout (``sim_watch``)."""
        wake = self._wake[rank]
        poll = min(self.timeout, self.POLL)
        while True:
            woke = wake.acquire(timeout=poll)
            if woke and slot.ready:                # the usual way: released by the last member
                return
            with self._lock:
                if rank in self._asleep:           # timed out and nobody released it
                    self._asleep.discard(rank)
                elif not woke:                     # released just after the timeout: take it
                    wake.acquire(blocking=False)
                if slot.ready:
                    return
                if self.failure is not None:
                    raise SimAborted(f"device {self.failure[0]} failed")
                missing = [group[i] for i, m in enumerate(slot.meta) if m is None]
                try:
                    self.watch.check(rank, kind, seq, group, missing)
                except (CollectiveTimeout, DeviceFinishedError) as err:
                    self.failure = self.failure or (rank, err)
                    self._wake_all()
                    raise
                self._asleep.add(rank)             # sleep again


def _own_copy(exc: Exception) -> Exception:
    """A new exception like ``exc`` for one device to raise (one instance raised on several
    threads would collect all their tracebacks)."""
    try:
        return type(exc)(*exc.args)
    except Exception:  # noqa: BLE001 - a type with another constructor
        return RuntimeError(f"{type(exc).__name__}: {exc}")


_WORLDS: dict[int, SimWorld] = {}


def _register(world: SimWorld) -> int:
    key = id(world)
    _WORLDS[key] = world
    return key


def _unregister(world: SimWorld) -> None:
    _WORLDS.pop(id(world), None)


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _reduction(op: str) -> Callable[[list, list[int]], torch.Tensor]:
    """Left-to-right reduction of the group's tensors into a new tensor (the order, and so the
    rounding, of ``functools.reduce(torch.add, data)``): the first two combined out of place,
    the others into that result."""
    fn = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]

    def combine(data: list, args: list[int]) -> torch.Tensor:
        if len(data) == 1:
            return _contiguous_copy(data[0])
        out = fn(data[0], data[1])
        for t in data[2:]:
            fn(out, t, out=out)
        return out
    return combine


def _whole(shared: torch.Tensor, idx: int, n: int, args: list[int]) -> torch.Tensor:
    """Every member's result is a copy of the whole shared tensor (also the member that computed
    it: it could write its result in place before the others have copied theirs)."""
    return _contiguous_copy(shared)


def _my_block(shared: torch.Tensor, idx: int, n: int, args: list[int]) -> torch.Tensor:
    return _contiguous_copy(shared.chunk(n, dim=args[0])[idx])


def _blocks(data: list, args: list[int]) -> list:
    return [t.chunk(len(data), dim=args[0]) for t in data]


def _my_blocks(shared: list, idx: int, n: int, args: list[int]) -> torch.Tensor:
    return torch.cat([blocks[idx] for blocks in shared], dim=args[1])


def _permuted(shared: list, idx: int, n: int, args: list[int]) -> torch.Tensor:
    """ppermute's result on member ``idx`` (args: flattened (source, destination) pairs;
    a member that receives nothing gets zeros)."""
    for src, dst in zip(args[0::2], args[1::2]):
        if dst == idx:
            return _contiguous_copy(shared[src])
    return torch.zeros_like(shared[idx], memory_format=torch.contiguous_format)


# kind -> (peers read a snapshot of the input after its owner may have left, the part of the
# result computed once per group, each member's result from it). Every result is a fresh
# contiguous tensor, as the fake kernel below promises (torch.compile relies on it), allocated
# on its member's own thread (per-thread memory accounting); the shared part is read-only.
_KINDS: dict[str, tuple[bool, Callable, Callable]] = {
    "all_reduce_sum": (False, _reduction("sum"), _whole),
    "all_reduce_max": (False, _reduction("max"), _whole),
    "all_reduce_min": (False, _reduction("min"), _whole),
    "all_gather": (False, lambda data, args: torch.cat(data, dim=args[0]), _whole),
    "reduce_scatter": (False, _reduction("sum"), _my_block),
    "all_to_all": (True, _blocks, _my_blocks),
    "permute": (True, lambda data, args: data, _permuted),
}


def run_collective(world: SimWorld, rank: int, x: torch.Tensor, kind: str, group: tuple[int, ...],
                   args: list[int]) -> torch.Tensor:
    """One simulated collective of ``rank`` over ``group`` (plain Python; the custom op below
    wraps it for torch.compile)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown simulated collective {kind!r}")
    snapshot, shared_part, mine = _KINDS[kind]
    # A snapshot where peers read the input after this device has returned (it may overwrite
    # x in place at once, as inductor does with its buffers); otherwise the combined result is
    # computed while every member still waits inside the rendezvous.
    payload = _contiguous_copy(x.detach()) if snapshot else x.detach()
    meta = (kind, tuple(x.shape), x.dtype, tuple(args))
    shared = world.rendezvous(rank, group, payload, meta, lambda data: shared_part(data, args))
    return mine(shared, group.index(rank), len(group), args)


@torch.library.custom_op("fpp_sim::collective", mutates_args=())
def _sim_collective(x: torch.Tensor, kind: str, group: list[int], rank: int, world: int,
                    args: list[int]) -> torch.Tensor:
    """One simulated collective (an opaque op, so torch.compile traces it)."""
    return run_collective(_WORLDS[world], rank, x, kind, tuple(group), list(args))


@torch.library.custom_op("fpp_sim::collective_axes", mutates_args=())
def _sim_collective_axes(x: torch.Tensor, kind: str, axes: str, n: int, world: int,
                         args: list[int]) -> torch.Tensor:
    """One simulated collective over the group along ``axes`` (space-separated mesh axes) of
    the device running it (the running thread's device context): a compiled graph with this
    op serves every device."""
    from functional_pp.core.runtime import current_context
    ctx = current_context()
    group = ctx.mesh.group(ctx.rank, tuple(axes.split()))
    return run_collective(_WORLDS[world], ctx.rank, x, kind, group, list(args))


def _fake_result(x: torch.Tensor, kind: str, n: int, args: list[int]) -> torch.Tensor:
    shape = list(x.shape)
    if kind == "all_gather":
        shape[args[0]] *= n
    elif kind == "reduce_scatter":
        shape[args[0]] //= n
    elif kind == "all_to_all":
        shape[args[0]] //= n
        shape[args[1]] *= n
    return x.new_empty(shape)     # contiguous, like every real result (see _KINDS)


@_sim_collective.register_fake
def _(x, kind, group, rank, world, args):
    return _fake_result(x, kind, len(group), args)


@_sim_collective_axes.register_fake
def _(x, kind, axes, n, world, args):
    return _fake_result(x, kind, n, args)


class SimBackend:
    """Backend of one simulated rank."""

    name = "simulated"

    def __init__(self, world: SimWorld, rank: int):
        self.world = world
        self.rank = rank
        self._key = _register(world)

    def _op(self, x, kind, group, args=()):
        if runs_eagerly(x):              # plain Python: no custom-op dispatch in eager code
            # (no autograd either: run_collective computes from detached inputs only)
            return run_collective(self.world, self.rank, x, kind, group if type(group) is tuple else tuple(group), args)
        if hasattr(group, "axes"):       # traced: the group of whichever device runs the graph
            return torch.ops.fpp_sim.collective_axes(x, kind, " ".join(group.axes), len(group), self._key,
                                                     list(args))
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

    def all_to_all_v(self, x: torch.Tensor, send, recv, group: tuple[int, ...]) -> torch.Tensor:
        """Uneven all-to-all along dim 0 (eager only: the sizes are data): ``send[j]`` rows of
        ``x`` go to group member j, ``recv[j]`` rows come from it (docs/experts.md)."""
        if not runs_eagerly(x):
            raise RuntimeError("all_to_all_v: the uneven all-to-all of expert parallelism runs eagerly "
                               "(its sizes are data); run the step without compile")
        group = group if type(group) is tuple else tuple(group)
        meta = ("all_to_all_v", tuple(x.shape[1:]), x.dtype)
        payload = (_contiguous_copy(x.detach()), tuple(int(s) for s in send))
        shared = self.world.rendezvous(self.rank, group, payload, meta, list)
        me = group.index(self.rank)
        blocks = []
        for src, (data, sizes) in enumerate(shared):
            start = sum(sizes[:me])
            if sizes[me] != int(recv[src]):
                raise RuntimeError(f"all_to_all_v: member {me} expects {int(recv[src])} rows from member "
                                   f"{src}, which sends {sizes[me]}")
            blocks.append(data[start:start + sizes[me]])
        return torch.cat(blocks, dim=0).clone(memory_format=torch.contiguous_format)

    def exchange_objects(self, obj, group: tuple[int, ...]) -> list:
        """Non-tensor exchange for checks (not counted as communication)."""
        return self.world.exchange(self.rank, group, obj, ("exchange_objects",))
