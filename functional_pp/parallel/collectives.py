"""Collectives over named mesh axes (JAX names), differentiable with the transposes of
docs/collectives.md (written out in functional_pp/parallel/transposes.py), counted in the
communication report.

``axis_name`` is one mesh axis or a tuple of them; a tuple forms one group whose index is
first-axis-major (``("dp_shard", "cp")``: index = dp_shard_index * cp_size + cp_index).

Inside :func:`functional_pp.shard_map` they follow JAX's ``shard_map(check_vma=True)``: every
tensor knows the mesh axes it varies over (functional_pp/parallel/vma.py), a collective casts
an operand invariant over its axes to varying first (``psum`` of a replicated value sums its
copies, and its gradient is summed back), and its result is typed as JAX types it
(docs/manual_mode.md). Called directly inside ``launch``, outside any shard_map, they are
untyped: the caller writes every :func:`pvary` (the explicit style, which works in both).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import torch

from functional_pp._torch import apply_function
from functional_pp.core.runtime import current_context
from functional_pp.parallel import vma as V
from functional_pp.parallel.raw_collectives import (AxesGroup, AxisName, _axes, _group,  # noqa: F401 (re-exported)
                                                    _norm_dim, _reduce_dtype, local_chunk)
from functional_pp.parallel.raw_collectives import axis_index as _raw_axis_index
from functional_pp.parallel.raw_collectives import (axis_size, raw_all_gather, raw_all_reduce, raw_all_to_all,
                                                    raw_permute, raw_reduce_scatter)
from functional_pp.parallel.transposes import _PSumScatter  # noqa: F401
from functional_pp.parallel.transposes import (_AllGather, _AllGatherInvariant, _AllToAll, _AllToAllV, _PMax, _PPermute,
                                               _PSum, _PVary, _SliceVarying, _SplitInvariant, set_gradient_sink)

_UNTYPED = contextlib.nullcontext()


def _quiet(st):
    return _UNTYPED if st is None else st.suspend()


def _vma(st, x) -> frozenset:
    return frozenset() if st is None else st.vma(x)


def _summed(x: torch.Tensor, axes: tuple[str, ...], op: str):
    """The state and ``x`` for a sum over ``axes`` (psum, psum_scatter): an ``x`` varying over
    some of them and invariant over others is refused, as JAX refuses it (whether the copies
    of the invariant part are meant to be summed is the caller's to say)."""
    st = V.current()
    if st is None:
        return None, x
    have = st.vma(x)
    live = [a for a in axes if a in st.live]
    varying, invariant = [a for a in live if a in have], [a for a in live if a not in have]
    if varying and invariant:
        raise ValueError(
            f"{op}: {V.describe(x, st.origin(x))} varies over mesh axis {varying[0]!r} but is invariant "
            f"over {invariant[0]!r}, and {op} over {axes} must see one or the other on all of them "
            f"(as JAX's): {op} over {tuple(varying)} only, or cast it first, "
            f"functional_pp.pvary(x, {tuple(invariant)!r}), to sum its identical copies over "
            f"{tuple(invariant)!r} as well")
    return st, st.cast(x, axes)


def _done(st, x: torch.Tensor, out: torch.Tensor, vma, origin: str) -> torch.Tensor:
    if st is not None and out is not x:
        st.set(out, vma, origin)
    return out


def _trivial(axes: tuple[str, ...]) -> bool:
    mesh = current_context().mesh
    return mesh.axis_size(mesh.check_axes(axes, "collective")) == 1


def psum(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Sum over the devices of ``axis_name``; the result is invariant (backward: identity).
    In a shard_map, an ``x`` invariant over ``axis_name`` is cast to varying first (JAX): the
    sum of its identical copies, whose gradient is summed back over the devices."""
    axes = _axes(axis_name)
    st, x = _summed(x, axes, "psum")
    with _quiet(st):
        out = x if _trivial(axes) else apply_function(_PSum, x, axes)
    return _done(st, x, out, _vma(st, x) - set(axes), "psum")


def pmean(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Mean over the devices of ``axis_name``."""
    axes = _axes(axis_name)
    return psum(x, axes) / axis_size(axes)


def pmax(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Maximum over the devices of ``axis_name``, invariant. Backward: the cotangent split
    equally among the devices holding the maximum (``jnp.max``'s rule for ties), so a
    replicated ``x`` gets its cotangent once, not once per device."""
    return max_over(x, (), axis_name)


def pmin(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Minimum over the devices of ``axis_name`` (ties as :func:`pmax`)."""
    return -pmax(-x, axis_name)


def max_over(x: torch.Tensor, dims: Iterable[int], axis_name: AxisName | None) -> torch.Tensor:
    """Maximum over this block's dimensions ``dims`` and over the devices of ``axis_name``
    (None or empty: none): the global maximum of a dimension split over those axes. Backward:
    the cotangent split equally among every tied entry of every device (so any layout gives
    one device's gradient, ties included)."""
    dims = tuple(sorted(_norm_dim(d, x.ndim) for d in dims))
    axes = _axes(axis_name) if axis_name else ()
    st, x = V.operand(x, axes) if axes else (V.current(), x)
    if axes and _trivial(axes):
        axes = ()
    with _quiet(st):
        if not axes:
            out = x.amax(dim=dims) if dims else x        # torch's amax splits ties the same way
        else:
            out = apply_function(_PMax, x, axes, dims)
    return _done(st, x, out, _vma(st, x) - set(axes), "pmax")


def pvary(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Cast an invariant value to varying over ``axis_name``: identity forward, psum backward.
    In a shard_map, ``x`` must be invariant over those axes (JAX refuses a cast of a varying
    value too); the ops insert the casts they need themselves."""
    axes = _axes(axis_name)
    st = V.current()
    if st is None:
        return x if _trivial(axes) else apply_function(_PVary, x, axes)
    current_context().mesh.check_axes(axes, "pvary")
    already = [a for a in axes if a in st.vma(x)]
    if already:
        raise ValueError(f"pvary: {V.describe(x, st.origin(x))} already varies over mesh axis {already[0]!r}; "
                         f"pvary casts an invariant value to varying (jax.lax.pcast(..., to='varying') "
                         f"refuses it as well): drop this pvary"
                         + (f", or pvary over {tuple(a for a in axes if a not in already)} only"
                            if len(already) < len(axes) else ""))
    return st.cast(x, axes)


def all_gather(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
               invariant: bool = False) -> torch.Tensor:
    """Gather the blocks of every device along ``axis`` (a new stacked axis unless ``tiled``).

    The result is varying (its backward is ``psum_scatter``). With ``invariant=True`` the
    caller promises every device uses the result identically, and the backward only takes
    this device's slice (JAX's ``all_gather_invariant``)."""
    axes = _axes(axis_name)
    st, x = V.operand(x, axes)
    with _quiet(st):
        y = x if tiled else x.unsqueeze(axis)
        if not _trivial(axes):
            fn = _AllGatherInvariant if invariant else _AllGather
            y = apply_function(fn, y, axes, _norm_dim(axis, y.ndim))
    vma = _vma(st, x)
    return _done(st, x, y, vma - set(axes) if invariant else vma, "all_gather")


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
    st, x = _summed(x, axes, "psum_scatter")
    with _quiet(st):
        out = x if _trivial(axes) else apply_function(_PSumScatter, x, axes, dim)
        out = out if tiled else out.squeeze(dim)
    return _done(st, x, out, _vma(st, x), "psum_scatter")


def ppermute(x: torch.Tensor, axis_name: AxisName, perm: Iterable[tuple[int, int]]) -> torch.Tensor:
    """Send this device's ``x`` to the device given by ``perm`` (pairs of axis indices
    (source, destination)); devices that receive nothing get zeros. Over a tuple of axes the
    indices are those of :func:`axis_index` over the same tuple (first axis major, in the
    tuple's order; JAX orders them by mesh position instead: docs/manual_mode.md)."""
    axes = _axes(axis_name)
    st, x = V.operand(x, axes)
    with _quiet(st):
        out = apply_function(_PPermute, x, axes, tuple((int(s), int(d)) for s, d in perm))
    return _done(st, x, out, _vma(st, x), "ppermute")


def all_to_all(x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int, *,
               tiled: bool = False) -> torch.Tensor:
    """Split ``split_axis`` into one block per device, send block j to device j, and
    concatenate the received blocks along ``concat_axis`` (JAX's shapes).

    ``tiled=False`` (JAX's default): ``split_axis`` must have the group's size n and is removed,
    and the n received values are stacked along a new axis at ``concat_axis`` of the result
    (shape (3, 6) -> (6, 3) for split 0, concat 1 over 3 devices). ``tiled=True``: ``split_axis``
    is split into n blocks (n must divide it) and they are concatenated along ``concat_axis``
    ((3, 6) -> (1, 18))."""
    axes = _axes(axis_name)
    n = axis_size(axes)
    s = _norm_dim(split_axis, x.ndim)
    c = _norm_dim(concat_axis, x.ndim)
    for name, d in (("split_axis", s), ("concat_axis", c)):
        if not 0 <= d < max(x.ndim, 1):
            raise ValueError(f"all_to_all: {name} {d} is out of range for a tensor of shape {tuple(x.shape)}")
    if tiled and x.shape[s] % n:
        raise ValueError(f"all_to_all over {axes} (size {n}) with tiled=True: split_axis {s} has size "
                         f"{x.shape[s]}, which {n} does not divide; pad it to a multiple of {n}")
    if not tiled and x.shape[s] != n:
        raise ValueError(f"all_to_all over {axes} (size {n}) with tiled=False (JAX's default) needs "
                         f"split_axis {s} of size {n}, got {x.shape[s]}; pass tiled=True to split it "
                         f"in {n} blocks")
    st, x = V.operand(x, axes)
    with _quiet(st):
        if tiled:
            out = x if n == 1 else apply_function(_AllToAll, x, axes, s, c)
        else:   # a new axis of size 1 where the result stacks, exchanged tiled, split_axis dropped
            p = c if c < s else c + 1
            s2 = s if p > s else s + 1
            y = x.unsqueeze(p)
            out = (y if n == 1 else apply_function(_AllToAll, y, axes, s2, p)).squeeze(s2)
    return _done(st, x, out, _vma(st, x), "all_to_all")


def all_to_all_v(x: torch.Tensor, axis_name: AxisName, send_sizes: Sequence[int],
                 recv_sizes: Sequence[int]) -> torch.Tensor:
    """Uneven all-to-all along dim 0: the first ``send_sizes[0]`` rows go to device 0 of the
    group, the next ``send_sizes[1]`` to device 1, ...; the result stacks the ``recv_sizes[j]``
    rows received from each device j in group order. The sizes are Python ints every device
    agrees on pairwise (exchange them first: :func:`exchange_sizes`); eager only. Backward:
    the same exchange with the sizes swapped (the combine of expert parallelism, docs/experts.md)."""
    axes = _axes(axis_name)
    st, x = V.operand(x, axes)
    with _quiet(st):
        out = apply_function(_AllToAllV, x, axes, tuple(int(s) for s in send_sizes),
                             tuple(int(r) for r in recv_sizes))
    return _done(st, x, out, _vma(st, x), "all_to_all_v")


def exchange_sizes(send_sizes: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Each device's ``send_sizes`` (integer, first dimension one entry per device of the
    group) exchanged so that row j of the result is what device j sends to this one (an even
    all-to-all of the counts; not differentiable)."""
    axes = _axes(axis_name)
    n = axis_size(axes)
    if send_sizes.shape[0] != n:
        raise ValueError(f"exchange_sizes over {axes} (size {n}): send_sizes needs {n} rows, got "
                         f"{tuple(send_sizes.shape)}")
    return send_sizes if n == 1 else raw_all_to_all(send_sizes.contiguous(), axes, 0, 0)


def split_invariant(x: torch.Tensor, axis_name: AxisName, dim: int) -> torch.Tensor:
    """This device's block of an invariant ``x`` along ``dim`` (free; backward all-gathers)."""
    axes = _axes(axis_name)
    st = V.current()
    if st is not None:
        varying = [a for a in axes if a in st.vma(x)]
        if varying:
            raise ValueError(f"split_invariant: {V.describe(x, st.origin(x))} varies over mesh axis "
                             f"{varying[0]!r}, so its blocks are not one value's: take this device's "
                             f"block with slice_varying(x, {axes!r}, {dim})")
    with _quiet(st):
        out = x if _trivial(axes) else apply_function(_SplitInvariant, x, axes, _norm_dim(dim, x.ndim))
    return _done(st, x, out, _vma(st, x) | set(axes), "split_invariant")


def slice_varying(x: torch.Tensor, axis_name: AxisName, dim: int) -> torch.Tensor:
    """This device's block of ``x`` along ``dim``, where ``x`` varies (unsplit) over
    ``axis_name`` (free; backward zero-pads the cotangent back to the whole dimension)."""
    axes = _axes(axis_name)
    st, x = V.operand(x, axes)
    with _quiet(st):
        out = x if _trivial(axes) else apply_function(_SliceVarying, x, axes, _norm_dim(dim, x.ndim))
    return _done(st, x, out, _vma(st, x), "slice_varying")


def axis_index(axis_name: AxisName):
    """This device's index along ``axis_name`` (a tuple: first axis major). In a shard_map an
    int64 0-dim tensor varying over ``axis_name`` (JAX's ``axis_index`` is varying: a value
    computed from it varies too); outside one a Python int; in a batched simulation a tensor
    holding every device's index (docs/simulation.md)."""
    i = _raw_axis_index(axis_name)
    st = V.current()
    if st is None:
        return i
    t = i if isinstance(i, torch.Tensor) else torch.tensor(i)
    if not isinstance(i, torch.Tensor) or not st.vma(t):
        st.set(t, _axes(axis_name), "axis_index")
    return t
