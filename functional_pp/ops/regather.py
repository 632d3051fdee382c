"""Re-gathering: keep only the shard of a gathered weight (FSDP, ZeRO-3) or of a gathered
activation (sequence parallelism, ``regather_activations``) for backward and all-gather it again
when backward needs it, instead of saving the full tensor. A gather of a load-balanced
dimension is followed by a reorder into natural order; the recipe replays it
(docs/layouts.md)."""
from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from typing import Iterator, Sequence

import torch

from ..collectives import raw_all_gather
from ..named import Named, options
from ..order import from_balanced
from ..observers import saved_for_backward
from ..torch_private import is_tracing


@contextmanager
def _hooks(recipes) -> Iterator[None]:
    def root(t: torch.Tensor) -> torch.Tensor:
        return t._base if t._base is not None else t

    # Autograd keeps the pack hook alive with every saved tensor: hold only weak references
    # to the gathered tensors here, and how to rebuild them.
    gathered = {id(root(full)): (weakref.ref(root(full)), *recipe) for full, recipe in recipes}

    def pack(t: torch.Tensor):
        base = root(t)
        hit = gathered.get(id(base))
        if hit is not None and hit[0]() is base:
            _, shard, axes, dim, order = hit
            saved_for_backward(shard)
            return ("fpp-regather", shard.detach(), axes, dim, order, tuple(t.shape), t.stride(),
                    t.storage_offset())
        saved_for_backward(t)
        return t

    def unpack(p):
        if isinstance(p, tuple) and p[0] == "fpp-regather":
            _, shard, axes, dim, order, shape, stride, offset = p
            full = from_balanced(raw_all_gather(shard, axes, dim), dim, order)
            return full.as_strided(shape, stride, offset)
        return p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


_NOTHING = nullcontext()


def regather_scope(operands: Sequence[Named]):
    """Context for computing with ``operands``: gathered weights among them are not saved."""
    recipes = [(x.data, x.gathered_from) for x in operands if isinstance(x, Named) and x.gathered_from]
    if not recipes or options().keep_gathered or is_tracing() or not torch.is_grad_enabled():
        return _NOTHING
    return _hooks(recipes)
