"""FSDP re-gathering: keep only the shard of a gathered weight for backward and all-gather it
again when backward needs it (ZeRO-3), instead of saving the full weight."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator, Sequence

import torch

from ..collectives import raw_all_gather
from ..named import Named, options


@contextmanager
def _hooks(recipes) -> Iterator[None]:
    # Autograd keeps the pack hook alive with every saved tensor: hold no reference to the
    # gathered tensors here, only their storage address, dtype and how to rebuild them.
    ptrs = {full.untyped_storage().data_ptr(): (full.dtype, shard, axes, dim)
            for full, (shard, axes, dim) in recipes}

    def pack(t: torch.Tensor):
        hit = ptrs.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if hit is not None and t.dtype == hit[0]:
            _, shard, axes, dim = hit
            return ("fpp-regather", shard.detach(), axes, dim, tuple(t.shape), t.stride(), t.storage_offset())
        return t

    def unpack(p):
        if isinstance(p, tuple) and p[0] == "fpp-regather":
            _, shard, axes, dim, shape, stride, offset = p
            full = raw_all_gather(shard, axes, dim)
            return full.as_strided(shape, stride, offset)
        return p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def regather_scope(operands: Sequence[Named]):
    """Context for computing with ``operands``: gathered weights among them are not saved."""
    if options().keep_gathered or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return nullcontext()
    recipes = [(x.data, x.gathered_from) for x in operands if isinstance(x, Named) and x.gathered_from]
    return _hooks(recipes) if recipes else nullcontext()
