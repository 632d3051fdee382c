"""Joining the process group from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``; docs/bad_inputs.md §4). Under torchrun (its agent sets ``TORCHELASTIC_RUN_ID``
and has gathered the ranks already) the group is joined as torch does. Without it the variables
may be left in the shell by another launch: a plain ``functional-pp train`` then waited up to the
collective timeout (600 s) in silence for ranks that never come. There the rendezvous waits at
most :data:`UNMANAGED_WAIT` seconds and fails naming the variables and how to train alone."""
from __future__ import annotations

import datetime
import os

__all__ = ["RendezvousError", "join_from_env", "UNMANAGED_WAIT", "ENV"]

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
UNMANAGED_WAIT = 30.0        # seconds the ranks of a launch without torchrun's agent wait for each other


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
    try:
        store = dist.TCPStore(host, port, world, rank == 0, datetime.timedelta(seconds=wait),
                              wait_for_workers=True)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError / DistStoreError / TimeoutError
        who = (f"the other {world - 1} rank(s) did not join at port {port}" if rank == 0
               else f"rank 0's store at {host}:{port} did not answer")
        raise RendezvousError(f"{named} are set in the environment (not by torchrun: no TORCHELASTIC_RUN_ID), "
                              f"so this process is rank {rank} of {world}; {who} within {wait:.0f} s "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): {how}") from exc
    store.set_timeout(long)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=long)
