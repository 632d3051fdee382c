"""Gradients whose collective is still in flight: a :class:`PendingGrad` placeholder stands in
for a gradient while the asynchronous collective that reduces it runs (a gradient bucket's
all-reduce, functional_pp/parallel/buckets/eager.py, or an FSDP unit's reduce-scatter,
functional_pp/parallel/fsdp/units.py); :func:`resolve_pending` waits for them before the
optimizer.

Mechanism: Gradient buckets (gradients in flight: placeholders resolved before the optimizer; eager).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from functional_pp._torch import make_wrapper_subclass, tree_map


class Slot:
    """Where one gradient sits in the flat result of an asynchronous collective: a bucket's
    all-reduce, or an FSDP unit's reduce-scatter (``source``: anything with ``result()``, the
    awaited flat tensor, and ``device``)."""
    __slots__ = ("bucket", "offset", "numel", "shape", "dtype")

    def __init__(self, bucket, offset: int, numel: int, shape: torch.Size, dtype: torch.dtype):
        self.bucket, self.offset, self.numel, self.shape, self.dtype = bucket, offset, numel, shape, dtype

    def value(self) -> torch.Tensor:
        flat = self.bucket.result()
        out = flat[self.offset:self.offset + self.numel].view(self.shape)
        return out.to(self.dtype) if out.dtype != self.dtype else out


class PendingGrad(torch.Tensor):
    """A gradient whose all-reduce is (or will be) in flight. Any op on it waits for the
    reduction first; a cast to another dtype stays pending (applied after the wait)."""

    @staticmethod
    def __new__(cls, slot: Slot, casts: tuple[torch.dtype, ...] = ()):
        dtype = casts[-1] if casts else slot.dtype
        r = make_wrapper_subclass(cls, slot.shape, dtype=dtype, device=slot.bucket.device)
        r.slot, r.casts = slot, casts
        return r

    def resolve(self) -> torch.Tensor:
        """The reduced gradient (waits for its bucket)."""
        out = self.slot.value()
        for dtype in self.casts:
            out = out.to(dtype)
        return out

    def __repr__(self) -> str:
        return f"PendingGrad(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and len(args) == 1 and isinstance(args[0], PendingGrad)
                and set(kwargs) <= {"dtype"}):
            return PendingGrad(args[0].slot, args[0].casts + (kwargs.get("dtype", args[0].dtype),))
        unwrap = lambda t: t.resolve() if isinstance(t, PendingGrad) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def resolve_pending(grads: Sequence[Any]) -> list[Any]:
    """``grads`` with every :class:`PendingGrad` waited for: a view of its reduced flat
    buffer, not a copy (as DDP's ``gradient_as_bucket_view``); the views of one buffer are
    disjoint, so the optimizer may update each in place (step.buffers.own_buffers)."""
    return [g.resolve() if isinstance(g, PendingGrad) else g for g in grads]
