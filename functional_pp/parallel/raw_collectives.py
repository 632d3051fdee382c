"""The raw collectives: counted, non-differentiable collectives on this device's local
tensor over named mesh axes (JAX names), and the queries ``axis_index`` / ``axis_size``. The
differentiable ones are built on these in functional_pp/parallel/transposes.py (docs/collectives.md).

``axis_name`` is one mesh axis or a tuple of them; a tuple forms one group whose index is
first-axis-major (``("dp_shard", "cp")``: index = dp_shard_index * cp_size + cp_index).
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from functional_pp._torch import is_tracing
from functional_pp.core import comm
from functional_pp.core.mesh import as_axes
from functional_pp.core.runtime import current_context, current_policy

AxisName = str | Sequence[str]


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


def _group(axis_name: AxisName, where: str):
    ctx = current_context()
    axes = ctx.mesh.check_axes(axis_name, where)
    if ctx.batched or (ctx.simulated and is_tracing()):
        return ctx, axes, AxesGroup(axes, ctx.mesh.axis_size(axes))
    return ctx, axes, ctx.mesh.group(ctx.rank, axes)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _reduce_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Mixed precision: the dtype in which 16-bit values are summed (None: their own)."""
    want = current_policy().reduce_dtype
    return want if want is not None and x.dtype in (torch.bfloat16, torch.float16) else None


def raw_all_reduce(x: torch.Tensor, axes: AxisName, op: str = "sum") -> torch.Tensor:
    ctx, axes, group = _group(axes, f"p{op}")
    if len(group) == 1:
        return x
    wide = _reduce_dtype(x) if op == "sum" else None
    y = x.to(wide) if wide else x
    with comm.recording("all_reduce", axes, len(group), y):
        out = ctx.backend.all_reduce(y, op, group)
    return out.to(x.dtype) if wide else out


def raw_all_gather(x: torch.Tensor, axes: AxisName, dim: int) -> torch.Tensor:
    ctx, axes, group = _group(axes, "all_gather")
    if len(group) == 1:
        return x
    with comm.recording("all_gather", axes, len(group), x):
        return ctx.backend.all_gather(x, _norm_dim(dim, x.ndim), group)


def raw_reduce_scatter(x: torch.Tensor, axes: AxisName, dim: int) -> torch.Tensor:
    ctx, axes, group = _group(axes, "psum_scatter")
    if len(group) == 1:
        return x
    dim = _norm_dim(dim, x.ndim)
    if x.shape[dim] % len(group):
        raise ValueError(f"psum_scatter over {axes}: dimension {dim} of size {x.shape[dim]} is not "
                         f"divisible by the group size {len(group)}")
    wide = _reduce_dtype(x)
    y = x.to(wide) if wide else x
    with comm.recording("reduce_scatter", axes, len(group), y):
        out = ctx.backend.reduce_scatter(y, dim, group)
    return out.to(x.dtype) if wide else out


def raw_all_to_all(x: torch.Tensor, axes: AxisName, split_dim: int, concat_dim: int) -> torch.Tensor:
    ctx, axes, group = _group(axes, "all_to_all")
    if len(group) == 1:
        return x
    split_dim, concat_dim = _norm_dim(split_dim, x.ndim), _norm_dim(concat_dim, x.ndim)
    if x.shape[split_dim] % len(group):
        raise ValueError(f"all_to_all over {axes}: split dimension {split_dim} of size "
                         f"{x.shape[split_dim]} is not divisible by the group size {len(group)}")
    with comm.recording("all_to_all", axes, len(group), x):
        return ctx.backend.all_to_all(x, split_dim, concat_dim, group)


def raw_all_to_all_v(x: torch.Tensor, axes: AxisName, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
    """Uneven all-to-all along dim 0: ``send[j]`` rows of ``x`` go to group member j (in
    order), ``recv[j]`` rows come from member j; counted as the bytes sent to the others."""
    ctx, axes, group = _group(axes, "all_to_all_v")
    n = len(group)
    if len(send) != n or len(recv) != n or sum(send) != x.shape[0]:
        raise ValueError(f"all_to_all_v over {axes} (size {n}): send sizes {list(send)} and receive sizes "
                         f"{list(recv)} need {n} entries each, the send sizes summing to the rows of x "
                         f"({x.shape[0]})")
    if n == 1:
        return x
    if ctx.batched:                 # (refused by the batched backend, naming the alternatives)
        return ctx.backend.all_to_all_v(x, tuple(send), tuple(recv), group)
    me = ctx.mesh.axis_index(ctx.rank, axes)
    row = math.prod(x.shape[1:]) * x.element_size()
    with comm.recording("all_to_all", axes, n, x, sends=False):
        comm.record("all_to_all", axes, n, x, nbytes=row * (sum(send) - send[me]))
        return ctx.backend.all_to_all_v(x, tuple(int(s) for s in send), tuple(int(r) for r in recv), group)


def raw_permute(x: torch.Tensor, axes: AxisName, pairs: Iterable[tuple[int, int]]) -> torch.Tensor:
    ctx, axes, group = _group(axes, "ppermute")
    pairs = tuple((int(s), int(d)) for s, d in pairs)
    n = len(group)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if any(not 0 <= i < n for i in srcs + dsts) or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"ppermute over {axes}: perm {list(pairs)} must be pairs (source, destination) "
                         f"of distinct indices in range({n})")
    if n == 1:
        return x if pairs else torch.zeros_like(x)
    if ctx.batched:          # every device at once: recorded as a device that sends
        sends = any(s != d for s, d in pairs)
    else:
        me = ctx.mesh.axis_index(ctx.rank, axes)
        sends = any(s == me and d != me for s, d in pairs)
    with comm.recording("permute", axes, n, x, sends=sends):
        return ctx.backend.permute(x, pairs, group)


def local_chunk(x: torch.Tensor, axes: AxisName, dim: int) -> torch.Tensor:
    """This device's chunk of ``x`` along ``dim`` split over ``axes`` (a free slice, no
    communication)."""
    ctx, axes, group = _group(axes, "slice")
    n = len(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} over mesh axes {axes} "
                         f"of size {n}")
    if ctx.batched:
        return ctx.backend.local_chunk(x, axes, dim)
    return x.chunk(n, dim=dim)[ctx.mesh.axis_index(ctx.rank, axes)].contiguous()


def _axes(axis_name: AxisName) -> tuple[str, ...]:
    axes = as_axes(axis_name)
    if not axes:
        raise ValueError("a collective needs at least one mesh axis name")
    return axes


def axis_index(axis_name: AxisName) -> int:
    """This device's index along ``axis_name`` (a tuple: first axis major). In a batched
    simulation: an int64 0-dim tensor holding every device's index (docs/simulation.md)."""
    ctx = current_context()
    axes = ctx.mesh.check_axes(_axes(axis_name), "axis_index")
    if ctx.batched:
        key = ("axis_index", axes, getattr(ctx.backend, "device", None))     # (made on the run's device)
        found = ctx.extras.get(key)
        if found is None:
            found = ctx.extras[key] = ctx.backend.axis_index(axes)
        return found
    return ctx.mesh.axis_index(ctx.rank, axes)


def axis_size(axis_name: AxisName) -> int:
    """Number of devices along ``axis_name``."""
    mesh = current_context().mesh
    return mesh.axis_size(mesh.check_axes(_axes(axis_name), "axis_size"))
