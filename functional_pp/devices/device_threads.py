"""Leaving a batched run for one piece of per-device host work: :func:`on_device_threads` runs a
function on one thread per device under the threaded simulator, each with its own block of
the batched values (docs/simulation.md, "The training loop on the batched simulator"). The
training loop saves checkpoints this way: a save is per-rank file I/O with barriers between its
phases, cheap next to the steps, and its rank-0-only parts need a device that is rank 0.

Mechanism: Devices (batched simulator: per-device host work on threads).
"""
from __future__ import annotations

from typing import Any, Callable

from functional_pp.core.runtime import current_context, current_rank, thread_context

__all__ = ["on_device_threads"]


def on_device_threads(fn: Callable[[Any], Any], tree: Any, *, timeout: float = 300.0) -> list:
    """``fn(tree)`` on every device, the results in rank order. In a batched run
    (``launch(simulate="batched")``): ``fn(device r's block of tree)`` on one thread per device
    of the threaded simulator (collectives and ``exchange_objects`` as there, ``current_rank()``
    an int), ``tree``'s ``DeviceStack`` values split into the devices' blocks. Elsewhere (threaded
    simulation, torchrun, no launch): ``[fn(tree)]``, this device's result only."""
    ctx = current_context(required=False)
    if ctx is None or not ctx.batched:
        return [fn(tree)]
    from functional_pp.devices.batched_run import _block_of
    from functional_pp.devices.launch import _launch_threads
    blocks = [_block_of(tree, r) for r in range(ctx.mesh.size)]
    with thread_context(None):       # the device threads' launch is not nested
        return _launch_threads(lambda: fn(blocks[current_rank()]), ctx.mesh, timeout)
