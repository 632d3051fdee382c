"""Re-gathering: keep only the shard of a gathered weight (FSDP, ZeRO-3) or of a gathered
activation (sequence parallelism, ``regather_activations``) for backward and all-gather it again
when backward needs it, instead of saving the full tensor. A gather of a load-balanced
dimension is followed by a reorder into natural order; the recipe replays it
(docs/layouts.md). :func:`relayout` is the ops' relayout: the layout change of
functional_pp/parallel/reshard.py plus this bookkeeping.

Mechanism: FSDP (per weight, ZeRO-3: a gathered weight keeps its shard and is re-gathered in backward; eager).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from typing import Iterator, Sequence

import torch

from functional_pp._torch import is_tracing
from functional_pp.core.layout import Layout
from functional_pp.core.observers import saved_for_backward
from functional_pp.core.order import from_balanced
from functional_pp.core.saved_hooks import pack_other, unpack_other
from functional_pp.parallel.fsdp import param_uses
from functional_pp.parallel.fsdp.graph import regather_region
from functional_pp.parallel.collectives import raw_all_gather
from functional_pp.parallel.fsdp.role import gathered
from functional_pp.parallel.fsdp.units import keeps_gathered
from functional_pp.parallel.named import Named, configure, current_policy, make_named
from functional_pp.parallel.reshard import Reshard, all_gather_tiled, relayout_with, reshard


def relayout(x: Named, target: Layout, op: str = "relayout") -> Named:
    """:func:`functional_pp.parallel.reshard.relayout` for the ops: a parameter (or, with
    ``regather_activations``, an activation) gathered whole along one dimension remembers its
    shard (``gathered_from``), so that backward re-gathers it instead of saving it; under
    torch.compile a parameter's all-gather is tagged for the re-gather (functional_pp/compile/recompute.py)
    unless ``keep_gathered``. ``op`` names the operation in errors."""
    if isinstance(x, Named) and x._split == target and not x._partial:   # already there (common)
        return x
    return relayout_with(x, target, lambda x, target: _reshard_keeping_shard(x, target, op))


def _reshard_keeping_shard(x: Named, target: Layout, op: str) -> Reshard:
    tagged = x.is_param and not keeps_gathered(current_policy())
    done = reshard(x, target, op, _regathered_in_backward if tagged else all_gather_tiled)
    out = done.value
    if x.is_param and done.gathers and not x.tied:
        param_uses.record(x.data)            # gathered at several sites: tied from the next forward
    if ((x.is_param or current_policy().regather_activations) and len(done.gathers) == 1
            and out.data.requires_grad and not done.sliced):
        out = make_named(out.data, out.dims, out.split, out.vary, out.partial, out._sizes,
                         gathered(out.role, done.gathers[0]))
    return done._replace(value=out)


def _regathered_in_backward(data: torch.Tensor, axes: tuple, dim: int) -> torch.Tensor:
    with regather_region():                 # ZeRO-3 under compile
        return all_gather_tiled(data, axes, dim)


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
        return pack_other(t)              # (activation offloading, core/saved_hooks.py)

    def unpack(p):
        if isinstance(p, tuple) and p[0] == "fpp-regather":
            _, shard, axes, dim, order, shape, stride, offset = p
            full = from_balanced(raw_all_gather(shard, axes, dim), dim, order)
            return full.as_strided(shape, stride, offset)
        return unpack_other(p)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


_NOTHING = nullcontext()


def recomputed_region():
    """Context for a region that activation checkpointing recomputes in backward
    (``functional_pp.remat``): the weights gathered inside are kept for the region's backward
    instead of being re-gathered by this module's hooks (the recomputation gathers them again
    anyway; the hooks would replace the checkpoint's and keep the einsum inputs alive,
    docs/planning.md, "remat")."""
    return configure(keep_gathered=True)


def regather_scope(operands: Sequence[Named]):
    """Context for computing with ``operands``: gathered weights among them are not saved."""
    recipes = [(x.data, x.gathered_from) for x in operands if isinstance(x, Named) and x.gathered_from]
    if not recipes or keeps_gathered(current_policy()) or is_tracing() or not torch.is_grad_enabled():
        return _NOTHING
    return _hooks(recipes)
