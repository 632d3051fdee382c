"""EBFT's strided mode (energy-based fine-tuning, Jelassi et al. 2026, as Axolotl's
``AxolotlStridedEBFTTrainer`` computes it; docs/preference.md "EBFT") as pure functions of
tensors: the anchors of a document's blocks, each block's features from a frozen model's hidden
states, their whitening, the feature-matching rewards and the advantages.

Shapes: a document's ``B`` blocks, ``n`` samples per block; features ``[..., n, D]`` for the
samples and ``[..., D]`` for the document's own tokens (the reference) at the same positions."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["EMBED_METHODS", "ADVANTAGE_ESTIMATORS", "feature_layer_indices", "strided_anchors", "block_features",
           "row_block_features", "whiten", "block_rewards", "block_advantages"]

#: ``ebft.embed_method`` values of the strided mode (how a block's token features are pooled)
EMBED_METHODS = ("last_token", "mean_pooling")
#: ``ebft.advantage_estimator`` values
ADVANTAGE_ESTIMATORS = ("rloo", "group_norm", "reinforce")


def feature_layer_indices(feature_layers: Sequence[float], n_layers: int) -> list[int]:
    """The hidden-state indices ``int(f * n_layers)`` of ``feature_layers`` (fractions of the
    depth; 0: the embeddings, 1: the final normed states), as Axolotl reads them."""
    bad = [f for f in feature_layers if not 0 <= float(f) <= 1]
    if not feature_layers or bad:
        raise ValueError(f"ebft.feature_layers must be fractions of the depth in [0, 1], got {list(feature_layers)}"
                         f" (e.g. [0.25, 0.5, 0.75])")
    return [int(float(f) * n_layers) for f in feature_layers]


def strided_anchors(seq_len: int, *, stride: int, context_length: int, generate_max_len: int,
                    prompt_length: int | None = None, min_completion_prefix: int = 0) -> list[int]:
    """The positions where a document of ``seq_len`` tokens starts its blocks: ``a + b * stride``
    for ``b < (seq_len - generate_max_len - a) // stride + 1``, from ``a = context_length``, or
    with a prompt of ``prompt_length`` tokens from ``a = max(prompt_length +
    min_completion_prefix, context_length)`` (each block of ``generate_max_len`` tokens inside
    the document). Empty when the document is too short."""
    for key, v in (("stride", stride), ("generate_max_len", generate_max_len)):
        if v < 1:
            raise ValueError(f"ebft.{key} must be >= 1, got {v}")
    if context_length < 1:
        raise ValueError(f"ebft.context_length must be >= 1 (a block needs a token before it), got {context_length}")
    start = context_length if prompt_length is None else max(prompt_length + min_completion_prefix, context_length)
    count = (seq_len - generate_max_len - start) // stride + 1
    return [start + b * stride for b in range(max(0, count))]


def block_features(states: Sequence[torch.Tensor], embed_method: str) -> torch.Tensor:
    """A block's feature vector ``[..., D]`` from the hidden states of its tokens, one tensor
    ``[..., T, H]`` per feature layer: each L2-normalised per token, concatenated (``D = layers x
    H``), then pooled over the ``T`` tokens by ``embed_method`` (``last_token``: the last one;
    ``mean_pooling``: their mean)."""
    if embed_method not in EMBED_METHODS:
        raise ValueError(f"ebft.embed_method {embed_method!r} is not one of {', '.join(EMBED_METHODS)} (the strided "
                         f"mode's)")
    x = torch.cat([F.normalize(h, p=2, dim=-1) for h in states], dim=-1)
    return x[..., -1, :] if embed_method == "last_token" else x.mean(dim=-2)


def row_block_features(states: Sequence[torch.Tensor], starts: torch.Tensor, length: int,
                       embed_method: str, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The block features ``[M, D]`` (:func:`block_features`) of the hidden states (``[N, S, H]``
    per feature layer) at positions ``starts[i] .. starts[i] + length - 1`` of row ``rows[i]``
    (None: row ``i``, one block per row)."""
    pos = starts.to(torch.long).view(-1, 1) + torch.arange(length, device=starts.device)
    rows = torch.arange(len(starts)) if rows is None else rows.to(torch.long)
    if (int(pos.max()) >= states[0].shape[1] or int(starts.min()) < 0 or len(rows) != len(starts)
            or int(rows.max()) >= states[0].shape[0]):
        raise ValueError(f"row_block_features: blocks of {length} tokens from {starts.tolist()} in rows "
                         f"{rows.tolist()} leave the {states[0].shape[0]} rows of {states[0].shape[1]} tokens")
    picked = [h[rows.view(-1, 1).to(h.device), pos.to(h.device)] for h in states]
    return block_features(picked, embed_method)


def whiten(phi: torch.Tensor, phi_ref: torch.Tensor, tol: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phi W, phi_ref W)`` with ``W = U diag(1 / s_i) U^T`` over the singular values ``s_i >
    tol * max s`` (0 for the others) of the samples' features ``phi`` (``[n, D]``, as columns
    ``D x n``): the samples decorrelated, the reference (``[..., D]``) mapped alike."""
    u, s, _ = torch.linalg.svd(phi.T, full_matrices=False)
    inv = torch.where(s > tol * s.max(), 1.0 / (s + 1e-12), torch.zeros_like(s))
    w = (u * inv) @ u.T
    return phi @ w, phi_ref @ w


def block_rewards(phi: torch.Tensor, phi_ref: torch.Tensor, *, alignment_coef: float = 1.0,
                  diversity_coef: float = 1.0, use_whitening: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards, alignment, diversity)``, each ``[..., n]``, of the ``n`` samples of each block
    (``phi`` ``[..., n, D]``, the reference ``phi_ref`` ``[..., D]``; ``use_whitening``:
    :func:`whiten` per block first): ``alignment_j = 2 cos(phi_j, phi_ref)``, ``diversity_j = 2 /
    (n - 1) sum_{k != j} phi_j . phi_k`` (0 when ``n = 1``), ``r_j = alignment_coef *
    alignment_j - diversity_coef * diversity_j``."""
    n, d = phi.shape[-2:]
    if phi_ref.shape[-1] != d or phi_ref.shape[:-1] != phi.shape[:-2]:
        raise ValueError(f"block_rewards: the reference's features {tuple(phi_ref.shape)} do not match the samples' "
                         f"{tuple(phi.shape)} (expected {tuple(phi.shape[:-2]) + (d,)})")
    ref = phi_ref.unsqueeze(-2)
    if use_whitening:
        flat, flat_ref = phi.reshape(-1, n, d), ref.reshape(-1, 1, d)
        pairs = [whiten(p, r) for p, r in zip(flat, flat_ref)]
        phi = torch.stack([p for p, _ in pairs]).view(phi.shape)
        ref = torch.stack([r for _, r in pairs]).view(ref.shape)
    alignment = 2 * F.cosine_similarity(phi, ref.expand_as(phi), dim=-1)
    if n > 1:
        sims = phi @ phi.transpose(-1, -2)
        off = sims - torch.diag_embed(torch.diagonal(sims, dim1=-2, dim2=-1))
        diversity = 2 * off.sum(-1) / (n - 1)
    else:
        diversity = torch.zeros_like(alignment)
    return alignment_coef * alignment - diversity_coef * diversity, alignment, diversity


def block_advantages(rewards: torch.Tensor, estimator: str = "rloo") -> torch.Tensor:
    """Each sample's advantage among its block's ``n`` samples (``rewards`` ``[..., n]``):
    ``rloo`` ``r_j - mean_{k != j} r_k``; ``group_norm`` ``(r_j - mean) / (std + 1e-8)`` (Bessel's
    std); ``reinforce`` ``r_j``, as every estimator when ``n = 1``."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"ebft.advantage_estimator {estimator!r} is not one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    n = rewards.shape[-1]
    if n == 1 or estimator == "reinforce":
        return rewards.clone()
    if estimator == "rloo":
        return rewards - (rewards.sum(-1, keepdim=True) - rewards) / (n - 1)
    return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-8)
