"""Activation checkpointing for functions over named arrays: keep only the inputs and
recompute the function (its collectives included) in backward."""
from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch
from torch.utils.checkpoint import checkpoint

from .named import Named


def _flatten(tree: Any):
    return optree.tree_flatten(tree, is_leaf=lambda x: isinstance(x, Named), none_is_leaf=False)


def remat(fn: Callable[..., Named]) -> Callable[..., Named]:
    """Wrap ``fn(*args) -> Named`` so that backward recomputes it instead of keeping its
    activations. Named arguments (anywhere in pytrees) keep their layouts."""
    @functools.wraps(fn)
    def wrapped(*args):
        leaves, spec = _flatten(args)
        slots = [i for i, x in enumerate(leaves) if isinstance(x, Named)]
        meta: dict = {}

        def inner(*datas):
            rebuilt = list(leaves)
            for i, data in zip(slots, datas):
                x = leaves[i]
                y = Named(data, x.dims, x.split, x.vary, x.partial)
                y.is_param = x.is_param
                rebuilt[i] = y
            out = fn(*optree.tree_unflatten(spec, rebuilt))
            meta["out"] = (out.dims, out.split, out.vary, out.partial)
            return out.data
        data = checkpoint(inner, *[leaves[i].data for i in slots], use_reentrant=False)
        dims, split, vary, partial = meta["out"]
        return Named(data, dims, split, vary, partial)
    return wrapped
