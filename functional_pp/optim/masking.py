"""Masks (which leaves a transformation applies to) and decoupled weight decay."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import optree
import torch

from functional_pp._torch import is_tracing
from functional_pp.optim.base import (INHERIT, EmptyState, GradientTransformation, PyTree, check_number, transform,
                                      tree_leaves)

Mask = Union[PyTree, Callable[[PyTree], PyTree], None]
MaskOrFn = Mask   # the earlier name


def decay_mask_by_ndim(params: PyTree) -> PyTree:
    """Weight-decay mask: ``True`` for tensors with ``ndim >= 2`` (not norm scales, biases)."""
    return optree.tree_map(lambda p: p.ndim >= 2, params, none_is_leaf=False)


def mask_by_path(predicate: Callable[[tuple, torch.Tensor], bool]) -> Callable[[PyTree], PyTree]:
    """A mask ``callable(params)`` from a per-leaf ``predicate(path, leaf) -> bool``, where
    ``path`` is the leaf's key path, e.g. ``("layers", 0, "w")``."""

    def mask(params: PyTree) -> PyTree:
        paths, leaves, spec = optree.tree_flatten_with_path(params, none_is_leaf=False)
        return optree.tree_unflatten(spec, [bool(predicate(tuple(p), x)) for p, x in zip(paths, leaves)])

    return mask


def resolve_mask(mask: Mask, params: PyTree) -> Optional[PyTree]:
    """``mask`` as a pytree of Python bools with the structure of ``params`` (``None``: all).

    ``mask`` is ``None``, such a tree, or ``callable(params)`` returning one (for a per-leaf
    predicate use :func:`mask_by_path`). Leaves are Python bools, fixed when a step compiles."""
    if mask is None:
        return None
    if callable(mask):
        try:
            tree = mask(params)
        except TypeError as e:
            raise TypeError(f"mask(params) failed ({e}); a mask is a tree of bools or a callable(params) returning "
                            f"one; for a per-leaf predicate(path, leaf) use optim.mask_by_path(predicate)") from e
    else:
        tree = mask
    flags = tree_leaves(tree)
    same = len(flags) == len(tree_leaves(params)) and all(isinstance(b, bool) for b in flags)
    if same and not is_tracing():        # (tree structures are not traceable)
        same = optree.tree_structure(tree, none_is_leaf=False) == optree.tree_structure(params, none_is_leaf=False)
    if not same:
        made = "mask(params) returned" if callable(mask) else "the mask is"
        raise ValueError(f"{made} a tree with {len(flags)} leaves ({type(flags[0]).__name__ if flags else 'none'}, "
                         f"...), not a tree of Python bools with the structure of the parameters "
                         f"({len(tree_leaves(params))} leaves); pass a tree of bools, a callable(params) "
                         f"returning one, or optim.mask_by_path(lambda path, leaf: ...)")
    return tree


def add_decayed_weights(weight_decay: float = 0.0, mask: Mask = None) -> GradientTransformation:
    """``updates + weight_decay * params`` on the leaves selected by ``mask`` (see
    :func:`resolve_mask`). Needs ``params``; in place when the updates are donated."""
    weight_decay = check_number("add_decayed_weights", "weight_decay", weight_decay, low=0.0,
                                hint=" (weight decay is a finite number >= 0, e.g. 0.1)")

    def update(updates: PyTree, state: EmptyState, params: PyTree = None, *, donate_updates: bool = False,
               **extra: Any):
        if params is None:
            raise ValueError("add_decayed_weights needs the parameters: call update(updates, state, params)")
        if weight_decay == 0.0:
            return updates, state
        keep = resolve_mask(mask, params)
        u_leaves, spec = optree.tree_flatten(updates, none_is_leaf=False)
        p_leaves = tree_leaves(params)
        flags = tree_leaves(keep) if keep is not None else [True] * len(u_leaves)
        sel = [i for i, k in enumerate(flags) if k]
        if not sel:
            return updates, state
        us, ps = [u_leaves[i] for i in sel], [p_leaves[i].to(u_leaves[i].dtype) for i in sel]
        if donate_updates:
            torch._foreach_add_(us, ps, alpha=weight_decay)
            return updates, state
        out = list(u_leaves)
        for i, y in zip(sel, torch._foreach_add(us, ps, alpha=weight_decay)):
            out[i] = y
        return optree.tree_unflatten(spec, out), state

    return transform(lambda params: EmptyState(), update, INHERIT)
