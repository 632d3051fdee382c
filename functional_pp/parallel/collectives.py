"""Collectives over named mesh axes (JAX names), differentiable with the transposes of
docs/collectives.md (written out in functional_pp/parallel/transposes.py), counted in the
communication report.

``axis_name`` is one mesh axis or a tuple of them; a tuple forms one group whose index is
first-axis-major (``("dp_shard", "cp")``: index = dp_shard_index * cp_size + cp_index).
These work on plain local tensors (manual mode): like ``shard_map`` with ``check_vma=False``,
the caller says where an invariant value meets varying data by calling :func:`pvary`.
"""
from __future__ import annotations

from typing import Iterable

import torch

from functional_pp._torch import apply_function
from functional_pp.core.runtime import current_context
from functional_pp.parallel.raw_collectives import (AxesGroup, AxisName, _axes, _group,  # noqa: F401 (re-exported)
                                                    _local_chunk, _norm_dim, _reduce_dtype, axis_index, axis_size,
                                                    raw_all_gather, raw_all_reduce, raw_all_to_all, raw_permute,
                                                    raw_reduce_scatter)
from functional_pp.parallel.transposes import _PSumScatter  # noqa: F401
from functional_pp.parallel.transposes import (_AllGather, _AllGatherInvariant, _AllToAll, _PMax, _PPermute, _PSum,
                                               _PVary, _SliceVarying, _SplitInvariant, set_gradient_sink)


def _trivial(axes: tuple[str, ...]) -> bool:
    mesh = current_context().mesh
    return mesh.axis_size(mesh.check_axes(axes, "collective")) == 1


def psum(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Sum over the devices of ``axis_name``; the result is invariant (backward: identity)."""
    axes = _axes(axis_name)
    return x if _trivial(axes) else apply_function(_PSum, x, axes)


def pmean(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Mean over the devices of ``axis_name``."""
    axes = _axes(axis_name)
    return psum(x, axes) / axis_size(axes)


def pmax(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Maximum over the devices of ``axis_name`` (gradient flows to the maximal entries)."""
    axes = _axes(axis_name)
    return x if _trivial(axes) else apply_function(_PMax, x, axes)


def pvary(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Cast an invariant value to varying over ``axis_name``: identity forward, psum backward."""
    axes = _axes(axis_name)
    return x if _trivial(axes) else apply_function(_PVary, x, axes)


def all_gather(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
               invariant: bool = False) -> torch.Tensor:
    """Gather the blocks of every device along ``axis`` (a new stacked axis unless ``tiled``).

    The result is varying (its backward is ``psum_scatter``). With ``invariant=True`` the
    caller promises every device uses the result identically, and the backward only takes
    this device's slice (JAX's ``all_gather_invariant``)."""
    axes = _axes(axis_name)
    if not tiled:
        x = x.unsqueeze(axis)
    if _trivial(axes):
        return x
    fn = _AllGatherInvariant if invariant else _AllGather
    return apply_function(fn, x, axes, _norm_dim(axis, x.ndim))


def psum_scatter(x: torch.Tensor, axis_name: AxisName, *, scatter_dimension: int = 0,
                 tiled: bool = False) -> torch.Tensor:
    """Sum over ``axis_name`` and keep this device's block of ``scatter_dimension``.
    Without ``tiled`` the dimension must have the group's size and is removed."""
    axes = _axes(axis_name)
    dim = _norm_dim(scatter_dimension, x.ndim)
    n = axis_size(axes)
    if not tiled and x.shape[dim] != n:
        raise ValueError(f"psum_scatter over {axes} (size {n}) with tiled=False needs dimension "
                         f"{dim} of size {n}, got {x.shape[dim]}; pass tiled=True to split it in blocks")
    out = x if _trivial(axes) else apply_function(_PSumScatter, x, axes, dim)
    return out if tiled else out.squeeze(dim)


def ppermute(x: torch.Tensor, axis_name: AxisName, perm: Iterable[tuple[int, int]]) -> torch.Tensor:
    """Send this device's ``x`` to the device given by ``perm`` (pairs of axis indices
    (source, destination)); devices that receive nothing get zeros."""
    axes = _axes(axis_name)
    return apply_function(_PPermute, x, axes, tuple((int(s), int(d)) for s, d in perm))


def all_to_all(x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int) -> torch.Tensor:
    """Split ``split_axis`` into one block per device, send block j to device j, and
    concatenate the received blocks along ``concat_axis`` (tiled semantics)."""
    axes = _axes(axis_name)
    if _trivial(axes):
        return x
    return apply_function(_AllToAll, x, axes, _norm_dim(split_axis, x.ndim), _norm_dim(concat_axis, x.ndim))


def split_invariant(x: torch.Tensor, axis_name: AxisName, dim: int) -> torch.Tensor:
    """This device's block of an invariant ``x`` along ``dim`` (free; backward all-gathers)."""
    axes = _axes(axis_name)
    return x if _trivial(axes) else apply_function(_SplitInvariant, x, axes, _norm_dim(dim, x.ndim))


def slice_varying(x: torch.Tensor, axis_name: AxisName, dim: int) -> torch.Tensor:
    """This device's block of ``x`` along ``dim``, where ``x`` varies (unsplit) over
    ``axis_name`` (free; backward zero-pads the cotangent back to the whole dimension)."""
    axes = _axes(axis_name)
    return x if _trivial(axes) else apply_function(_SliceVarying, x, axes, _norm_dim(dim, x.ndim))
