"""What one device sees of the mesh for a collective over some axes: its group, its index
along them, its chunk of a value split over them, whether it sends in a permutation. A rank
answers for itself; the batched simulator answers for every device at once through its
backend's methods (devices/batched.py). The raw collectives (parallel/raw_collectives.py) ask
here, so the kinds of devices differ only inside ``devices/`` (docs/simulation.md).

The layers above ask here too for what else depends on the kind of device: where a value's
memory is (:func:`physical`), per-device values (:func:`per_device`, :func:`as_device`,
:func:`register_block_type`), the host's view (:func:`runs_all_devices`, :func:`is_lead`,
:func:`agree_to_stop`, :func:`lead_value`), and code with a twin for every device at once
(:func:`one_rank_or_every_device`). No module outside ``devices/`` reads a context's
``batched`` flag or imports a simulator (tests/test_architecture.py).

Mechanism: Devices (the seam the layers above ask: one rank, or every device at once).
"""
from __future__ import annotations

import math
from typing import Any, Callable, TypeVar

import torch

from functional_pp._torch import is_tracing
from functional_pp.core import comm
from functional_pp.core.runtime import current_context
from functional_pp.devices.device_stack import physical

__all__ = ["AxesGroup", "group", "axis_index", "local_chunk", "sends_in_permute", "all_to_all_v", "pad_block",
           "refuse_batched", "one_rank_or_every_device", "physical", "register_block_type", "block_type",
           "per_device", "as_device", "runs_all_devices", "is_lead", "agree_to_stop", "lead_value"]

T = TypeVar("T")


class AxesGroup:
    """The group along ``axes`` of whichever device runs the code: what a collective traced
    on simulated devices names instead of a tuple of ranks, so the traced graph does not
    depend on the tracing device's rank and every device reuses one compilation
    (docs/compile.md). The simulated collective resolves the ranks when it runs."""

    __slots__ = ("axes", "size")

    def __init__(self, axes: tuple[str, ...], size: int):
        self.axes, self.size = axes, size

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other: object) -> bool:      # one group per axes (gradient buckets key on it)
        return isinstance(other, AxesGroup) and (self.axes, self.size) == (other.axes, other.size)

    def __hash__(self) -> int:
        return hash((self.axes, self.size))


def group(ctx: Any, axes: tuple[str, ...]):
    """The group of a collective over ``axes``: the ranks of this device's group, or an
    :class:`AxesGroup` where the code runs for every device (batched) or is traced once for
    all simulated devices."""
    if ctx.batched or (ctx.simulated and is_tracing()):
        return AxesGroup(axes, ctx.mesh.axis_size(axes))
    return ctx.mesh.group(ctx.rank, axes)


def axis_index(ctx: Any, axes: tuple[str, ...]) -> int | torch.Tensor:
    """This device's index along ``axes``; batched: a 0-dim int64 tensor of every device's."""
    if ctx.batched:
        key = ("axis_index", axes, getattr(ctx.backend, "device", None))     # (made on the run's device)
        found = ctx.extras.get(key)
        if found is None:
            found = ctx.extras[key] = ctx.backend.axis_index(axes)
        return found
    return ctx.mesh.axis_index(ctx.rank, axes)


def local_chunk(ctx: Any, x: torch.Tensor, axes: tuple[str, ...], dim: int, n: int) -> torch.Tensor:
    """This device's chunk of ``x`` along ``dim`` split ``n`` ways over ``axes``."""
    if ctx.batched:
        return ctx.backend.local_chunk(x, axes, dim)
    return x.chunk(n, dim=dim)[ctx.mesh.axis_index(ctx.rank, axes)].contiguous()


def sends_in_permute(ctx: Any, axes: tuple[str, ...], pairs: tuple[tuple[int, int], ...]) -> bool:
    """Whether this device sends anything in the permutation ``pairs`` (batched: whether any
    device does; the run is recorded as one device that sends)."""
    if ctx.batched:
        return any(s != d for s, d in pairs)
    me = ctx.mesh.axis_index(ctx.rank, axes)
    return any(s == me and d != me for s, d in pairs)


def all_to_all_v(ctx: Any, x: torch.Tensor, axes: tuple[str, ...], send: tuple, recv: tuple, grp) -> torch.Tensor:
    """The uneven all-to-all, counted as the bytes this device sends to the others (batched:
    refused by its backend, naming the alternatives)."""
    if ctx.batched:
        return ctx.backend.all_to_all_v(x, tuple(send), tuple(recv), grp)
    n = len(grp)
    me = ctx.mesh.axis_index(ctx.rank, axes)
    row = math.prod(x.shape[1:]) * x.element_size()
    with comm.recording("all_to_all", axes, n, x, sends=False):
        comm.record("all_to_all", axes, n, x, nbytes=row * (sum(send) - send[me]))
        return ctx.backend.all_to_all_v(x, tuple(int(s) for s in send), tuple(int(r) for r in recv), grp)


def pad_block(ctx: Any, g: torch.Tensor, axes: Any, dim: int) -> torch.Tensor:
    """``g`` (this device's block along ``dim``) zero-padded to the whole dimension at this
    device's index along ``axes``; batched: every device's block at its own index."""
    if ctx.batched:
        return ctx.backend.pad_block(g, axes, dim)
    axes = ctx.mesh.check_axes(axes, "slice_varying")
    i, size = ctx.mesh.axis_index(ctx.rank, axes), g.shape[dim]
    pad = [0, 0] * (g.ndim - dim - 1) + [i * size, (ctx.mesh.axis_size(axes) - i - 1) * size]
    return torch.nn.functional.pad(g, pad)


def refuse_batched(error: Exception) -> None:
    """Raise ``error`` (naming what cannot run and what to use instead) when the running code
    runs for every device at once (a batched simulation): the one test of the kind of device
    that code written for one rank needs (a compiled step, a pipeline, experts)."""
    if runs_all_devices():
        raise error


def one_rank_or_every_device(one_rank: Callable[[], T], every_device: Callable[[], T]) -> T:
    """``one_rank()`` where the running code runs for one device (a rank, a simulated thread,
    no launch), ``every_device()`` where it runs for every device at once (a batched
    simulation): for code with a twin written over the device dimension (ring attention's
    ``ops/attention_ring.py``)."""
    return every_device() if runs_all_devices() else one_rank()


# --- per-device values: a batched run stacks every device's block (devices/batched_run.py)

# type -> (its block of one device, the same value around another block)
_BLOCK_TYPES: dict[type, tuple[Callable[[Any], torch.Tensor], Callable[[Any, torch.Tensor], Any]]] = {}


def register_block_type(cls: type, block: Callable[[Any], torch.Tensor],
                        rebuild: Callable[[Any, torch.Tensor], Any]) -> None:
    """Let :func:`per_device` stack values of ``cls`` (and ``launch`` split them per device):
    ``block(x)`` is the device's tensor inside ``x``, ``rebuild(x, t)`` the same value around ``t``.
    The module that defines ``cls`` calls this (devices/ does not import it)."""
    _BLOCK_TYPES[cls] = (block, rebuild)


def block_type(cls: type) -> tuple[Callable[[Any], torch.Tensor], Callable[[Any, torch.Tensor], Any]] | None:
    """``(block, rebuild)`` registered for ``cls`` by :func:`register_block_type`, or None."""
    return _BLOCK_TYPES.get(cls)


def per_device(fn: Callable[[], Any]) -> Any:
    """``fn()`` for this device. In a batched simulation: ``fn()`` called once per device (with
    that device's rank and ``axis_index`` values, no collectives), the results stacked into one
    value for all devices (tensors and values of a :func:`register_block_type` type; other leaves
    must be equal on every device). Elsewhere (inside a launch) simply ``fn()``."""
    ctx = current_context()
    if not ctx.batched:
        return fn()
    return ctx.backend.per_device(fn)        # devices/batched_run.py


def as_device(rank: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` as device ``rank`` of the running batched simulation (refused elsewhere): that device's integer rank
    and ``axis_index`` values, no collectives (one device's share of :func:`per_device`)."""
    return current_context().backend.as_device(rank, fn)        # devices/batched_run.py


# --- the host's view: a rank is the host of one device, a batched run the host of all of them

def runs_all_devices() -> bool:
    """Whether the running code runs once for every device (a batched simulation)."""
    ctx = current_context(required=False)
    return ctx is not None and ctx.batched


def is_lead() -> bool:
    """Whether the running code does rank 0's host work: rank 0 under threads and torchrun,
    always in a batched run (the one host of all devices), and outside any launch."""
    ctx = current_context(required=False)
    return ctx is None or ctx.batched or ctx.rank == 0


def agree_to_stop(local: bool) -> bool:
    """True on every device if any device's ``local`` is (a batched run has one host: its own
    answer is every device's)."""
    ctx = current_context(required=False)
    if ctx is None or ctx.batched or ctx.mesh.size == 1:
        return local
    return any(ctx.backend.exchange_objects(local, tuple(range(ctx.mesh.size))))


def lead_value(fn: Callable[[], T]) -> T:
    """``fn()`` on this device; in a batched run, ``fn()`` as device 0 (integer rank, no
    collectives), for host values every device holds alike."""
    if not runs_all_devices():
        return fn()
    return as_device(0, fn)
