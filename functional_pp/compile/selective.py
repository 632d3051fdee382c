"""Selective (op-level) activation checkpointing: which results a recomputed region keeps.

``remat="selective"`` (docs/memory.md, "Selective recomputation") checkpoints each
``fpp.layer`` call like full remat, but keeps the results of the expensive ops -- matrix
products and attention kernels (:data:`SAVED_OPS`) -- and recomputes only the cheap ones
(norms, activations, rotary, casts, collectives). torchtitan's ``op`` policy
(``torchtitan/distributed/activation_checkpoint.py``) is the model; unlike it, every matrix
product is kept, not every second one.

Two consumers read the same list:

* eager: :func:`selective_contexts` is the ``context_fn`` of ``torch.utils.checkpoint``
  (torch's ``create_selective_checkpoint_contexts`` with :func:`policy`, through
  ``_torch.selective_checkpoint``): forward caches the
  kept results, recomputation takes them from the cache instead of running the op;
* compiled: :func:`functional_pp.compile.recompute.reissue_for_backward` keeps the graph nodes
  whose target :func:`saves` and recomputes the other members of the region.
"""
from __future__ import annotations

from typing import Any

import optree
import torch
from torch.utils.checkpoint import CheckpointPolicy

from functional_pp._torch.selective_checkpoint import selective_checkpoint_contexts
from functional_pp.core.observers import saved_for_backward

__all__ = ["SAVED_OPS", "saves", "policy", "selective_contexts"]

_aten = torch.ops.aten


def _overloads(*names: str) -> frozenset:
    """The ``.default`` overloads of the aten ops ``names`` that this torch build has."""
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


MATMULS = _overloads("mm", "bmm", "addmm", "baddbmm", "_scaled_mm", "_int_mm")
ATTENTION = _overloads("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                       "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable",
                       "_flash_attention_forward", "_efficient_attention_forward")
#: the ops whose results a selective region keeps (everything else in it is recomputed)
SAVED_OPS: frozenset = MATMULS | ATTENTION


def saves(target: Any) -> bool:
    """Whether a selective region keeps the result of ``target`` (an op overload or graph
    node target) instead of recomputing it."""
    return target in SAVED_OPS


def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torch's selective-checkpoint policy: keep :data:`SAVED_OPS`' results, recompute the rest.
    A kept result is announced as saved for backward (the planner counts it as an activation,
    :mod:`functional_pp.core.observers`)."""
    if not saves(func):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        for t in optree.tree_leaves(getattr(ctx, "op_output", None), none_is_leaf=False):
            if isinstance(t, torch.Tensor):
                saved_for_backward(t)
    return CheckpointPolicy.MUST_SAVE


def selective_contexts(region: str | None = None):
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: the forward context
    caches :data:`SAVED_OPS`' results, the recomputation context replays them (and raises,
    naming ``region``, where it issues them differently from the forward)."""
    return selective_checkpoint_contexts(policy, region)
