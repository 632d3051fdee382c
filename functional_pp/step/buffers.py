"""Buffers a training step owns or writes (docs/memory.md): gradients it may overwrite, the
master weights, the non-finite select and the donated-state copy."""
from __future__ import annotations

import bisect
from typing import Any

import torch

from functional_pp.core.tree import tree_iter, tree_map
from functional_pp.devices.mesh_view import physical


def device_of(tree: Any) -> torch.device | None:
    """The device of the first tensor of ``tree`` (None: no tensor)."""
    leaf = next((x for x in tree_iter(tree) if isinstance(x, torch.Tensor)), None)     # (no whole flatten)
    return None if leaf is None else leaf.device


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def keep_if(finite: torch.Tensor, new: Any, old: Any) -> Any:
    """``new`` where the step is finite, else ``old`` (a branch-free select: compiled steps)."""
    if not isinstance(new, torch.Tensor):
        return new
    return torch.where(finite, new, old)


def select_finite(finite: torch.Tensor, new: list, old: list) -> list:
    """``new[i]`` where the step is ``finite``, else ``old[i]``, chosen on the device (the list
    ``new`` is replaced item by item, so each new buffer can be freed once its select is made:
    eager, at most one leaf more than the step's own buffers). Deferred metrics' steps that make
    their state in new buffers (docs/eager_overhead.md "Host synchronisation")."""
    for i, o in enumerate(old):
        n = new[i]
        if isinstance(n, torch.Tensor) and n is not o:
            new[i] = torch.where(finite, n, o)
        n = None
    return new


def write_into(old: Any, new: Any) -> Any:
    """``new`` copied into the buffers of ``old`` (a tree of the same structure) wherever the
    shapes and dtypes agree; the tree of ``old``'s tensors. Compiled steps with donated state:
    the copies are input mutations that inductor stores straight into the inputs
    (docs/memory.md "Donated state")."""
    def write(o: Any, n: Any) -> Any:
        if (isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor) and o is not n
                and o.shape == n.shape and o.dtype == n.dtype):
            return o.copy_(n)
        return n
    return tree_map(write, old, new)


def own_buffers(grads: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients as tensors the optimizer may overwrite: a gradient that shares memory with a
    parameter, overlaps another gradient (autograd may hand one tensor to two inputs) or is not
    dense (an expanded gradient) is copied first. Disjoint views of one buffer (the gradients
    of one all-reduce bucket, functional_pp/parallel/buckets/pending.py) are kept as they are."""
    params_at = {physical(p).untyped_storage().data_ptr() for p in params}
    local_grads = [physical(g) for g in grads]
    ptrs = [x.untyped_storage().data_ptr() for x in local_grads]
    if len(set(ptrs)) == len(ptrs) and params_at.isdisjoint(ptrs) and all(x.is_contiguous() for x in local_grads):
        return list(grads)      # each its own storage, none a parameter's: nothing can overlap (the usual case)
    taken: dict[int, list[tuple[int, int]]] = {}      # storage -> byte spans given out, sorted
    out = []
    for g, local, ptr in zip(grads, local_grads, ptrs):
        span = _byte_span(local)
        if ptr in params_at or not local.is_contiguous() or _overlaps(taken.get(ptr, ()), span):
            g = g.clone(memory_format=torch.contiguous_format)
            local = physical(g)
            ptr, span = local.untyped_storage().data_ptr(), _byte_span(local)
        if span[0] < span[1]:
            bisect.insort(taken.setdefault(ptr, []), span)
        out.append(g)
    return out


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) of its storage a contiguous tensor occupies."""
    start = t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def _overlaps(spans: list[tuple[int, int]], span: tuple[int, int]) -> bool:
    """Whether ``span`` meets one of the sorted disjoint ``spans`` (empty spans meet nothing)."""
    if span[0] == span[1]:
        return False
    i = bisect.bisect_left(spans, span)
    return any(s < span[1] and span[0] < e for s, e in spans[max(i - 1, 0):i + 1])


def acc_dtype(leaves) -> torch.dtype:
    return torch.float64 if torch.float64 in {x.dtype for x in leaves} else torch.float32


def master_copy(x: torch.Tensor) -> torch.Tensor:
    """Master weights are at least fp32 (16-bit parameters are upcast) and contiguous: a shard
    may be a strided view of a full tensor, and a compiled step, whose new parameters are
    contiguous, would recompile for the changed strides on its second call."""
    x = x.detach()
    return (x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x).contiguous()
