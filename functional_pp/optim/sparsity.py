"""Sparse fine-tuning (llm-compressor's ``ConstantPruningModifier``, Axolotl's LLMCompressorPlugin):
the zeros of the targeted weights stay zero through training.

The mask is taken once, when the optimizer state is made from the loaded weights (the modifier's
``start: 0``): an entry trains where ``|w| > epsilon`` (the modifier's ``1e-8``). After each update
the targeted weights are multiplied by it (the modifier's ``OPTIM_POST_STEP``: ``weight *= mask``),
so the other entries train exactly as without it. Here the last transformation of the chain returns
``-w`` in place of the update where the mask is false, so ``w + update`` is zero there.

The mask is param-like state (bools): it is sharded with its weight (FSDP, TP), checkpointed and
resumed with the optimizer. A leaf not targeted holds a broadcast ``True`` (no memory)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from functional_pp.core.tree import leaves_with_paths, map_with_path
from functional_pp.optim.base import (INHERIT, GradientTransformation, PyTree, check_number, transform, tree_flatten,
                                      tree_leaves, tree_unflatten)

__all__ = ["KeepZerosState", "keep_zeros", "EPSILON"]

#: llm-compressor's ConstantPruningModifier keeps an entry where ``|w| > 10e-9``
EPSILON = 10e-9


class KeepZerosState(NamedTuple):
    """State of :func:`keep_zeros`: ``keep`` mirrors the parameters (bool tensors: True where the
    entry trains; a broadcast True for a leaf not targeted)."""

    keep: PyTree
    param_like_fields = ("keep",)   # class attribute, not a field


def keep_zeros(targets: Callable[[str], bool], epsilon: float = EPSILON) -> GradientTransformation:
    """Keep the zeros of the parameters whose path ``targets(path)`` accepts: their entries with
    ``|w| <= epsilon`` when the state is made are zero after every update. Put it last in a
    chain (after the learning rate): it needs ``params``."""
    epsilon = check_number("keep_zeros", "epsilon", epsilon, low=0.0, hint=" (e.g. 1e-8)")
    if not callable(targets):
        raise TypeError(f"keep_zeros: targets must be callable(path) -> bool, got {targets!r}")

    def init(params: PyTree) -> KeepZerosState:
        def mask(path: str, p: torch.Tensor) -> torch.Tensor:
            if targets(path):
                return p.detach().abs() > epsilon
            return torch.ones((), dtype=torch.bool, device=p.device).expand(p.shape)
        return KeepZerosState(keep=map_with_path(mask, params))

    def update(updates: PyTree, state: KeepZerosState, params: PyTree = None, **extra: Any):
        if params is None:
            raise ValueError("keep_zeros needs the parameters: call update(updates, state, params)")
        u_leaves, spec = tree_flatten(updates)
        paths = leaves_with_paths(params)
        out = [torch.where(k, u, -p.to(u.dtype)) if targets(path) else u
               for u, (path, p), k in zip(u_leaves, paths, tree_leaves(state.keep))]
        return tree_unflatten(spec, out), state

    return transform(init, update, INHERIT)
