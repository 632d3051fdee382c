"""What one device sees of the mesh for a collective over some axes: its group, its index
along them, its chunk of a value split over them, whether it sends in a permutation. A rank
answers for itself; the batched simulator answers for every device at once through its
backend's methods (devices/batched.py). The raw collectives (parallel/raw_collectives.py) ask
here, so the kinds of devices differ only inside ``devices/`` (docs/simulation.md).

Mechanism: Devices (the seam the raw collectives ask: one rank, or every device at once).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from functional_pp._torch import is_tracing
from functional_pp.core import comm


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
    from functional_pp.core.runtime import current_context
    ctx = current_context(required=False)
    if ctx is not None and ctx.batched:
        raise error
