"""The raw collectives: counted, non-differentiable collectives on this device's local
tensor over named mesh axes (JAX names), and the queries ``axis_index`` / ``axis_size``. The
differentiable ones are built on these in functional_pp/parallel/transposes.py (docs/collectives.md).

``axis_name`` is one mesh axis or a tuple of them; a tuple forms one group whose index is
first-axis-major (``("dp_shard", "cp")``: index = dp_shard_index * cp_size + cp_index).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from functional_pp.core import comm
from functional_pp.core.mesh import as_axes
from functional_pp.core.runtime import current_context, current_policy
from functional_pp.devices import mesh_view
from functional_pp.devices.mesh_view import AxesGroup  # noqa: F401 (re-exported)

AxisName = str | Sequence[str]


def _group(axis_name: AxisName, where: str):
    ctx = current_context()
    axes = ctx.mesh.check_axes(axis_name, where)
    return ctx, axes, mesh_view.group(ctx, axes)


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
    return mesh_view.all_to_all_v(ctx, x, axes, send, recv, group)


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
    with comm.recording("permute", axes, n, x, sends=mesh_view.sends_in_permute(ctx, axes, pairs)):
        return ctx.backend.permute(x, pairs, group)


def local_chunk(x: torch.Tensor, axes: AxisName, dim: int) -> torch.Tensor:
    """This device's chunk of ``x`` along ``dim`` split over ``axes`` (a free slice, no
    communication)."""
    ctx, axes, group = _group(axes, "slice")
    n = len(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} over mesh axes {axes} "
                         f"of size {n}")
    return mesh_view.local_chunk(ctx, x, axes, dim, n)


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
    return mesh_view.axis_index(ctx, axes)


def axis_size(axis_name: AxisName) -> int:
    """Number of devices along ``axis_name``."""
    mesh = current_context().mesh
    return mesh.axis_size(mesh.check_axes(_axes(axis_name), "axis_size"))
