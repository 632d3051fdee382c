"""The collectives' transposes written out: one autograd Function per collective, whose
backward is the collective's transpose (the table is docs/collectives.md). The public,
differentiable collectives that apply them are in functional_pp/parallel/collectives.py."""
from __future__ import annotations

from typing import Callable

import torch

from functional_pp._torch import is_tracing
from functional_pp.compile.recompute import traced_as_backward
from functional_pp.core.runtime import current_context, per_thread
from functional_pp.devices import mesh_view
from functional_pp.parallel.raw_collectives import (local_chunk, raw_all_gather, raw_all_reduce, raw_all_to_all,
                                                    raw_all_to_all_v, raw_permute, raw_reduce_scatter)


# One Function per collective, its forward and its transpose (the backward) named in the class;
# the table of transposes is docs/collectives.md. The non-tensor arguments (mesh axes,
# dimensions, pairs) are kept for backward by _Collective.setup_context as ``ctx.args``.
class _Collective(torch.autograd.Function):
    """Base of the collectives' autograd functions: ``forward(x, *args)`` with one tensor;
    ``setup_context`` keeps ``args`` for the backward."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]


def _transpose(collective: Callable) -> staticmethod:
    """A backward that applies ``collective`` to the cotangent with the forward's other arguments
    (mesh axes, dimension): for the collectives whose transpose takes the same arguments."""
    @traced_as_backward
    def backward(ctx, g):
        return (collective(g, *ctx.args),) + (None,) * len(ctx.args)
    return staticmethod(backward)


class _PSum(_Collective):
    """psum (all-reduce, sum) over ``axes``. Transpose: identity, since the result is invariant
    (Megatron's *g*)."""

    @staticmethod
    def forward(x, axes):
        return raw_all_reduce(x, axes, "sum")

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        return g, None


_sink = per_thread("parallel.transposes")
_process_sink: list = [None]


def set_gradient_sink(sink: Callable[[torch.Tensor, tuple[str, ...]], torch.Tensor] | None,
                      process_wide: bool = False) -> None:
    """On this thread, hand the psum of a pvary'd leaf's gradient (a parameter's data-parallel
    reduction) to ``sink(g, axes)`` instead of all-reducing it at once (functional_pp/parallel/buckets/eager.py);
    None restores the immediate all-reduce. ``process_wide`` (one device per process) also
    reaches backward functions that autograd runs on its own device threads (CUDA)."""
    _sink.value = sink
    _process_sink[0] = sink if process_wide else None


def _feeds_leaf(x: torch.Tensor) -> bool:
    """Whether ``x`` is a leaf that requires grad (a parameter) or a dtype cast of one: by
    ``x.to`` or by an autograd function that casts leaves only and says so (``casts_leaves``:
    the step's one foreach copy of every parameter, step/precision_cast.py)."""
    if x.is_leaf:
        return x.requires_grad
    fn = x.grad_fn
    if getattr(getattr(fn, "_forward_cls", None), "casts_leaves", False):
        return all(type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions if f is not None)
    return (type(fn).__name__ == "ToCopyBackward0" and len(fn.next_functions) == 1
            and type(fn.next_functions[0][0]).__name__ == "AccumulateGrad")


class _PVary(torch.autograd.Function):
    """pvary: the invariant -> varying cast over ``axes``; forward is identity. Transpose: psum
    (the data-parallel gradient all-reduce, Megatron's *f*), handed to the gradient sink for a
    parameter (:func:`set_gradient_sink`)."""

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
    """pmax: the maximum over this block's dimensions ``dims`` (none for the collective
    ``pmax``) and all-reduce (max) over ``axes``. Transpose: the cotangent split equally among
    the tied entries, counted over ``dims`` and every device of ``axes`` (``jnp.max``'s rule),
    so a maximum held by k entries gives each 1/k of the cotangent whatever the layout."""

    @staticmethod
    def forward(x, axes, dims):
        m = x.amax(dim=dims) if dims else x
        return raw_all_reduce(m, axes, "max")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axes, ctx.dims = inputs[1], inputs[2]
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        for d in ctx.dims:                     # (sorted) back to x's rank
            out, g = out.unsqueeze(d), g.unsqueeze(d)
        tied = (x == out).to(g.dtype)
        count = tied.sum(dim=ctx.dims, keepdim=True) if ctx.dims else tied
        count = raw_all_reduce(count, ctx.axes, "sum")
        return g * tied / count, None, None


class _AllGather(_Collective):
    """all_gather along ``dim`` (tiled), a varying result. Transpose: psum_scatter along the
    same dimension (FSDP's gradient reduce-scatter)."""

    forward = staticmethod(raw_all_gather)
    backward = _transpose(raw_reduce_scatter)


class _PSumScatter(_Collective):
    """psum_scatter along ``dim`` (tiled): sum, keep this device's block. Transpose: all_gather
    along the same dimension."""

    forward = staticmethod(raw_reduce_scatter)
    backward = _transpose(raw_all_gather)


class _AllGatherInvariant(_Collective):
    """all_gather along ``dim`` whose result every device uses identically (invariant, JAX's
    ``all_gather_invariant``). Transpose: this device's block of the invariant cotangent (free)."""

    forward = staticmethod(raw_all_gather)
    backward = _transpose(local_chunk)


class _SplitInvariant(_Collective):
    """This device's block along ``dim`` of an invariant value (free). Transpose: all_gather."""

    forward = staticmethod(local_chunk)
    backward = _transpose(raw_all_gather)


class _SliceVarying(_Collective):
    """This device's block along ``dim`` of a value that varies (unsplit) over ``axes`` (free).
    Transpose: the cotangent zero-padded back to the whole dimension (the other blocks did not
    reach this device's output, so their gradient here is zero)."""

    forward = staticmethod(local_chunk)

    @staticmethod
    def backward(ctx, g):
        axes, dim = ctx.args
        return mesh_view.pad_block(current_context(), g, axes, dim), None, None


class _PPermute(_Collective):
    """ppermute: send to the partner given by ``pairs`` (source, destination). Transpose: the
    inverse permutation (every pair reversed)."""

    @staticmethod
    def forward(x, axes, pairs):
        return raw_permute(x, axes, pairs)

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        axes, pairs = ctx.args
        return raw_permute(g, axes, tuple((d, s) for s, d in pairs)), None, None


class _AllToAllV(_Collective):
    """Uneven all_to_all along dim 0 (``send[j]`` rows to member j, ``recv[j]`` from it).
    Transpose: the same exchange with the sizes swapped (what came from j goes back to j)."""

    @staticmethod
    def forward(x, axes, send, recv):
        return raw_all_to_all_v(x, axes, send, recv)

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        axes, send, recv = ctx.args
        return raw_all_to_all_v(g.contiguous(), axes, recv, send), None, None, None


class _AllToAll(_Collective):
    """all_to_all: split ``split_dim`` in one block per device, concatenate the received blocks
    along ``concat_dim``. Transpose: the reverse all_to_all (split ``concat_dim``, concatenate
    along ``split_dim``)."""

    @staticmethod
    def forward(x, axes, split_dim, concat_dim):
        return raw_all_to_all(x, axes, split_dim, concat_dim)

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        axes, split_dim, concat_dim = ctx.args
        return raw_all_to_all(g, axes, concat_dim, split_dim), None, None, None
