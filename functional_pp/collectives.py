"""Collectives over named mesh axes (JAX names), differentiable with the transposes of
docs/semantics.md, counted in the communication report.

``axis_name`` is one mesh axis or a tuple of them; a tuple forms one group whose index is
first-axis-major (``("dp_shard", "cp")``: index = dp_shard_index * cp_size + cp_index).
These work on plain local tensors (manual mode): like ``shard_map`` with ``check_vma=False``,
the caller says where an invariant value meets varying data by calling :func:`pvary`.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable, Sequence

import torch

from . import comm
from .mesh import as_axes
from .recompute import traced_as_backward
from .runtime import current_context, options
from .torch_private import apply_function, is_tracing

AxisName = str | Sequence[str]


# --------------------------------------------------------------------------- raw layer
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


def _group(axis_name: AxisName, where: str):
    ctx = current_context()
    axes = ctx.mesh.check_axes(axis_name, where)
    if ctx.simulated and is_tracing():
        return ctx, axes, AxesGroup(axes, ctx.mesh.axis_size(axes))
    return ctx, axes, ctx.mesh.group(ctx.rank, axes)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _reduce_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Mixed precision: the dtype in which 16-bit values are summed (None: their own)."""
    want = options().reduce_dtype
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


def raw_permute(x: torch.Tensor, axes: AxisName, pairs: Iterable[tuple[int, int]]) -> torch.Tensor:
    ctx, axes, group = _group(axes, "ppermute")
    pairs = tuple((int(s), int(d)) for s, d in pairs)
    n = len(group)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if any(not 0 <= i < n for i in srcs + dsts) or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"ppermute over {axes}: perm {list(pairs)} must be pairs (source, destination) "
                         f"of distinct indices in range({n})")
    me = ctx.mesh.axis_index(ctx.rank, axes)
    if n == 1:
        return x if pairs else torch.zeros_like(x)
    with comm.recording("permute", axes, n, x, sends=any(s == me and d != me for s, d in pairs)):
        return ctx.backend.permute(x, pairs, group)


def _local_chunk(x: torch.Tensor, axes: AxisName, dim: int) -> torch.Tensor:
    ctx, axes, group = _group(axes, "slice")
    n = len(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} over mesh axes {axes} "
                         f"of size {n}")
    return x.chunk(n, dim=dim)[ctx.mesh.axis_index(ctx.rank, axes)].contiguous()


# ------------------------------------------------------------------ autograd functions
class _PSum(torch.autograd.Function):
    """psum: all-reduce forward; the result is invariant so its backward is identity."""

    @staticmethod
    def forward(x, axes):
        return raw_all_reduce(x, axes, "sum")

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        return g, None


_sink = threading.local()
_process_sink: list = [None]


def set_gradient_sink(sink: Callable[[torch.Tensor, tuple[str, ...]], torch.Tensor] | None,
                      process_wide: bool = False) -> None:
    """On this thread, hand the psum of a pvary'd leaf's gradient (a parameter's data-parallel
    reduction) to ``sink(g, axes)`` instead of all-reducing it at once (functional_pp/buckets.py);
    None restores the immediate all-reduce. ``process_wide`` (one device per process) also
    reaches backward functions that autograd runs on its own device threads (CUDA)."""
    _sink.value = sink
    _process_sink[0] = sink if process_wide else None


def _feeds_leaf(x: torch.Tensor) -> bool:
    """Whether ``x`` is a leaf that requires grad (a parameter) or a dtype cast of one."""
    if x.is_leaf:
        return x.requires_grad
    fn = x.grad_fn
    return (type(fn).__name__ == "ToCopyBackward0" and len(fn.next_functions) == 1
            and type(fn.next_functions[0][0]).__name__ == "AccumulateGrad")


class _PVary(torch.autograd.Function):
    """pvary: invariant -> varying cast; identity forward, psum backward (deferred to the
    gradient sink for a parameter, see :func:`set_gradient_sink`)."""

    @staticmethod
    def forward(x, axes):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axes = inputs[1]
        ctx.param = not is_tracing() and _feeds_leaf(inputs[0])

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        sink = (getattr(_sink, "value", None) or _process_sink[0]) if ctx.param else None
        if sink is not None:
            return sink(g, ctx.axes), None
        return raw_all_reduce(g, ctx.axes, "sum"), None


class _PMax(torch.autograd.Function):
    @staticmethod
    def forward(x, axes):
        return raw_all_reduce(x, axes, "max")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        return g * (x == out).to(g.dtype), None


def _dim_collective(name: str, doc: str, forward, backward):
    """An autograd Function ``(x, axes, dim) -> forward(x, axes, dim)`` whose backward is
    ``backward(g, axes, dim)``: the collectives along one dimension and their transposes."""
    def fwd(x, axes, dim):
        return forward(x, axes, dim)

    def setup_context(ctx, inputs, output):
        ctx.axes, ctx.dim = inputs[1], inputs[2]

    def bwd(ctx, g):
        return backward(g, ctx.axes, ctx.dim), None, None

    return type(name, (torch.autograd.Function,), {
        "__doc__": doc, "forward": staticmethod(fwd), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(traced_as_backward(bwd))})


_AllGather = _dim_collective(
    "_AllGather", "all_gather (varying result): backward is psum_scatter on the same dimension.",
    raw_all_gather, raw_reduce_scatter)
_ReduceScatter = _dim_collective(
    "_ReduceScatter", "psum_scatter: backward is all_gather on the same dimension.",
    raw_reduce_scatter, raw_all_gather)
_AllGatherInvariant = _dim_collective(
    "_AllGatherInvariant", "all_gather whose result every device uses identically (invariant): "
    "backward takes this device's slice of the invariant cotangent.", raw_all_gather, _local_chunk)
_SplitInvariant = _dim_collective(
    "_SplitInvariant", "This device's slice of an invariant value (free); backward all-gathers.",
    _local_chunk, raw_all_gather)


class _PPermute(torch.autograd.Function):
    @staticmethod
    def forward(x, axes, pairs):
        return raw_permute(x, axes, pairs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axes, ctx.pairs = inputs[1], inputs[2]

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        return raw_permute(g, ctx.axes, tuple((d, s) for s, d in ctx.pairs)), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, axes, split_dim, concat_dim):
        return raw_all_to_all(x, axes, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axes, ctx.split, ctx.concat = inputs[1], inputs[2], inputs[3]

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        return raw_all_to_all(g, ctx.axes, ctx.concat, ctx.split), None, None, None


# ------------------------------------------------------------------------- public API
def _axes(axis_name: AxisName) -> tuple[str, ...]:
    axes = as_axes(axis_name)
    if not axes:
        raise ValueError("a collective needs at least one mesh axis name")
    return axes


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
    out = x if _trivial(axes) else apply_function(_ReduceScatter, x, axes, dim)
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


def axis_index(axis_name: AxisName) -> int:
    """This device's index along ``axis_name`` (a tuple: first axis major)."""
    ctx = current_context()
    return ctx.mesh.axis_index(ctx.rank, ctx.mesh.check_axes(_axes(axis_name), "axis_index"))


def axis_size(axis_name: AxisName) -> int:
    """Number of devices along ``axis_name``."""
    mesh = current_context().mesh
    return mesh.axis_size(mesh.check_axes(_axes(axis_name), "axis_size"))


def split_invariant(x: torch.Tensor, axis_name: AxisName, dim: int) -> torch.Tensor:
    """This device's block of an invariant ``x`` along ``dim`` (free; backward all-gathers)."""
    axes = _axes(axis_name)
    return x if _trivial(axes) else apply_function(_SplitInvariant, x, axes, _norm_dim(dim, x.ndim))
