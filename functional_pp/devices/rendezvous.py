"""Joining the process group from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``; docs/bad_inputs.md §4). Under torchrun (its agent sets ``TORCHELASTIC_RUN_ID``
and has gathered the ranks already) the group is joined as torch does. Without it the variables
may be left in the shell by another launch: a plain ``functional-pp train`` then waited up to the
collective timeout (600 s) in silence for ranks that never come. There the ranks must first
make contact within :data:`FIRST_CONTACT` seconds (a rank reaches rank 0's store; rank 0 hears
from one rank), else the run fails naming the variables and how to train alone: stray variables
fail in seconds. Once one has made contact, the rest of the ranks are waited for up to
:data:`UNMANAGED_WAIT` seconds (a launcher such as srun starts its ranks together)."""
from __future__ import annotations

import atexit
import datetime
import os
import time

__all__ = ["RendezvousError", "join_from_env", "leave", "leave_at_exit", "UNMANAGED_WAIT", "FIRST_CONTACT", "ENV"]

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
UNMANAGED_WAIT = 30.0        # seconds the ranks of a launch without torchrun's agent wait for each other
FIRST_CONTACT = 5.0          # seconds until a rank reaches rank 0's store (rank 0: until one rank has)
_JOINED = "functional_pp/rendezvous/joined"
_leave_registered = False


class RendezvousError(RuntimeError):
    """The ranks named by the environment did not find each other."""


def join_from_env(backend: str, timeout: float) -> None:
    """``torch.distributed.init_process_group(backend)`` from the environment, with collectives
    that give up after ``timeout`` seconds; outside torchrun the ranks' first meeting is bounded
    by ``min(timeout, UNMANAGED_WAIT)`` and a failure raises :class:`RendezvousError`."""
    import torch.distributed as dist
    long = datetime.timedelta(seconds=timeout)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        dist.init_process_group(backend, timeout=long)
        leave_at_exit()
        return
    named = ", ".join(f"{k}={os.environ.get(k, '<unset>')}" for k in ENV)
    how = ("to train in this process alone, unset them (unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT); to run "
           "several ranks, launch with torchrun")
    try:
        rank, world, host, port = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"],
                                   int(os.environ["MASTER_PORT"]))
    except (KeyError, ValueError) as exc:
        raise RendezvousError(f"{named} are set in the environment (not by torchrun), but not all of them as "
                              f"integers and a host: {how}") from exc
    wait = min(timeout, UNMANAGED_WAIT)
    contact = min(wait, FIRST_CONTACT)

    def refuse(who: str, seconds: float, exc: BaseException | None = None) -> RendezvousError:
        detail = f" ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})" if exc is not None else ""
        return RendezvousError(f"{named} are set in the environment (not by torchrun: no TORCHELASTIC_RUN_ID), "
                               f"so this process is rank {rank} of {world}; {who} within {seconds:.0f} s"
                               f"{detail}: {how}")
    try:
        store = dist.TCPStore(host, port, world, rank == 0, datetime.timedelta(seconds=contact),
                              wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError / DistStoreError / TimeoutError
        raise refuse(f"rank 0's store at {host}:{port} did not answer" if rank else
                     f"no store could be opened at port {port}", contact, exc) from exc
    if rank:
        store.add(_JOINED, 1)
    elif world > 1:
        _wait_for_ranks(store, world - 1, contact, wait, port, refuse)
    store.set_timeout(long)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=long)
    leave_at_exit()


def leave_at_exit() -> None:
    """Have :func:`leave` run when the interpreter exits (once per process, however often called):
    on joining, and by ``launch`` for a process group the caller initialised itself."""
    global _leave_registered
    if not _leave_registered:
        atexit.register(leave)
        _leave_registered = True


def leave() -> None:
    """Destroy the default process group, if it is still there (registered with :mod:`atexit`
    by :func:`leave_at_exit`): a group left to the interpreter's teardown can abort the process
    ("terminate called without an active exception", exit status -6) after its work is done."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _wait_for_ranks(store, others: int, contact: float, wait: float, port: int, refuse) -> None:
    """Rank 0: until ``others`` ranks have joined ``store``; none within ``contact`` seconds (stray
    variables), or not all within ``wait``, raises what ``refuse`` makes."""
    start = time.monotonic()
    while True:
        joined = store.add(_JOINED, 0)
        if joined >= others:
            return
        waited = time.monotonic() - start
        if joined == 0 and waited >= contact:
            raise refuse(f"the other {others} rank(s) did not join at port {port}", contact)
        if waited >= wait:
            raise refuse(f"{others - joined} of the other {others} rank(s) did not join at port {port}", wait)
        time.sleep(0.05)
