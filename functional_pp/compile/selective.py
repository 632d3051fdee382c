"""Selective (op-level) activation checkpointing: which results a recomputed region keeps.

``remat="selective"`` (docs/memory.md, "Selective recomputation") checkpoints each
``fpp.layer`` call like full remat, but keeps the results of the expensive ops -- matrix
products and attention kernels (:data:`SAVED_OPS`) -- and recomputes only the cheap ones
(norms, activations, rotary, casts, collectives). Two policies (:data:`POLICIES`), named by the
step's ``remat``:

* ``"selective"``: every matrix product's result is kept;
* ``"selective_alternate"``: torchtitan's ``op`` policy (``_custom_policy`` in
  ``torchtitan/distributed/activation_checkpoint.py``): every second matrix product of a region
  (its 2nd, 4th, ... in call order, counted separately in the forward and in the recomputation) is
  recomputed, the others kept. torchtitan counts ``aten.mm`` calls, which every linear projection
  is there; here every op of :data:`MATMULS` counts (a projection may be an ``mm`` or a ``bmm``).

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

from functional_pp._torch.selective_checkpoint import checkpoint_policy_sees_outputs, selective_checkpoint_contexts
from functional_pp.core.observers import saved_for_backward
from functional_pp.core.policy import SELECTIVE_REMAT

__all__ = ["SAVED_OPS", "POLICIES", "saves", "policy", "alternate_matmuls_policy", "selective_contexts",
           "is_selective"]

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
#: the selective policies, by the ``remat`` value that names them (core/policy.py's REMAT_MODES)
POLICIES = SELECTIVE_REMAT


def is_selective(remat: object) -> bool:
    """Whether a step's ``remat`` is one of the selective policies (:data:`POLICIES`)."""
    return isinstance(remat, str) and remat in POLICIES


def keeps_matmul(policy_name: str, count: int) -> bool:
    """Whether ``policy_name`` keeps the ``count``-th (from 1) matrix product of a region."""
    return policy_name != "selective_alternate" or count % 2 == 1


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


def alternate_matmuls_policy() -> Any:
    """torchtitan's op policy for one region: :func:`policy`, except that every second matrix
    product (counted per run: forward and recomputation each from 1) is recomputed."""
    counts = {False: 0, True: 0}

    def alternate(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in MATMULS:
            # torch <= 2.11 asks twice per forward op, the second time only to show its result
            # (_torch/selective_checkpoint.py): that ask is not another matrix product
            if ctx.is_recompute or checkpoint_policy_sees_outputs() or not hasattr(ctx, "op_output"):
                counts[ctx.is_recompute] += 1
            if not keeps_matmul("selective_alternate", counts[ctx.is_recompute]):
                return CheckpointPolicy.PREFER_RECOMPUTE
        return policy(ctx, func, *args, **kwargs)
    return alternate


def selective_contexts(region: str | None = None, policy_name: str = "selective"):
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` under ``policy_name``
    (:data:`POLICIES`): the forward context caches the kept results, the recomputation context
    replays them (and raises, naming ``region``, where it issues them differently from the forward)."""
    if policy_name not in POLICIES:
        raise ValueError(f"selective checkpointing policy {policy_name!r}: choose one of {POLICIES}")
    chosen = alternate_matmuls_policy() if policy_name == "selective_alternate" else policy
    return selective_checkpoint_contexts(chosen, region)
