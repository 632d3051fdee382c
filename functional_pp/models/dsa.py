"""DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5; docs/models.md): the option
of the latent attention (models/mla.py) on when ``Config.index_topk`` > 0.

Per query, a cheap scorer rates every earlier key and the attention keeps the ``index_topk`` best
(every key while a query has fewer). The scorer: ``index_heads`` query heads of ``index_head_dim``
entries from the q latent (``indexer_wq_b``), one key per token from the normed input
(``indexer_wk`` then a LayerNorm, ``indexer_k_norm``), both rotated on their first
``qk_rope_head_dim`` entries (``Config.index_rotary_interleaved``: GLM-5's pairs (2i, 2i + 1),
DeepSeek-V3.2's halves); a key's score is ``sum_h w_h * relu(q_h . k / sqrt(index_head_dim))``
with per-token head weights ``w = indexer_weights_proj(h) / sqrt(index_heads)``. As transformers
(``torch.no_grad`` on the indexer) the scores are float32 and the selection carries no gradient:
the indexer's parameters get none (DeepSeek's KL loss to the main attention is not in
transformers' forward, nor here). Parameters (``Q`` = q_lora_rank, ``I`` index heads, ``D`` their
width):

    indexer_wq_b          [Q, I, D]   q_rank index_head index_dim
    indexer_wk            [H, D]      hidden index_dim
    indexer_k_norm(_bias) [D]         index_dim
    indexer_weights_proj  [H, I]      hidden index_head
"""
from __future__ import annotations

import dataclasses

import torch

from functional_pp import ops
from functional_pp.parallel.named import Named, make_named, settle

__all__ = ["check_config", "init_indexer", "kept_keys", "zero_of_indexer", "K_NORM_EPS"]

K_NORM_EPS = 1e-6
"""The epsilon of the indexer key's LayerNorm (transformers' ``nn.LayerNorm(..., eps=1e-6)``)."""


def check_config(cfg) -> None:
    """Refuse, naming the field, a sparse-attention config the decoder cannot run."""
    if not cfg.index_topk:
        return
    if cfg.index_topk < 1 or not cfg.kv_lora_rank or not cfg.q_lora_rank:
        raise ValueError(f"index_topk={cfg.index_topk} (DeepSeek sparse attention) needs a positive top-k, latent "
                         f"attention (kv_lora_rank={cfg.kv_lora_rank}) and a q latent (q_lora_rank={cfg.q_lora_rank})")
    if cfg.index_heads < 1 or cfg.index_head_dim < cfg.qk_rope_head_dim:
        raise ValueError(f"index_heads={cfg.index_heads} must be positive and index_head_dim={cfg.index_head_dim} "
                         f"at least qk_rope_head_dim={cfg.qk_rope_head_dim} (its first entries rotate)")


def init_indexer(cfg, w) -> dict:
    """The declarations of one layer's indexer; ``w(shape, dims)`` declares one weight."""
    H, Q, I, D = cfg.hidden, cfg.q_lora_rank, cfg.index_heads, cfg.index_head_dim
    return dict(indexer_wq_b=w((Q, I, D), "q_rank index_head index_dim"), indexer_wk=w((H, D), "hidden index_dim"),
                indexer_k_norm=dataclasses.replace(w((D,), "index_dim"), init="ones"),
                indexer_k_norm_bias=dataclasses.replace(w((D,), "index_dim"), init="zeros"),
                indexer_weights_proj=w((H, I), "hidden index_head"))


def _local(x: Named, dims: tuple[str, ...]) -> torch.Tensor:
    """This device's block of ``x`` in the order ``dims`` (all but the batch whole)."""
    x = settle(x) if x._partial else x
    if any(s for d, s in zip(x.dims, x.split) if d != "batch"):
        raise ValueError(f"DeepSeek sparse attention: the indexer needs {dims[1:]} whole on each device, got the "
                         f"splits {dict(zip(x.dims, x.split))} (map no mesh axis to seq / index_heads / index_dim)")
    return x.data.permute([x.dims.index(d) for d in dims])


def zero_of_indexer(a: dict) -> torch.Tensor:
    """A zero that depends on this device's blocks of the indexer's parameters (added to the
    attention's output: their gradient is zeros, not none, so that a step treats them as any
    parameter while they stay what they are, as transformers' ``no_grad`` indexer)."""
    return sum((a[k].data * 0).sum() for k in sorted(a) if k.startswith("indexer_"))


def kept_keys(a: dict, h: Named, q_latent: Named, pos: Named, cfg, segments: Named | None = None) -> Named:
    """``batch seq key_seq``: True where the query keeps the key (its ``index_topk`` best earlier
    keys of its own document when ``segments``, batch seq, are given); ``h``: the normed input,
    ``q_latent``: the normed q latent (batch seq q_rank)."""
    seq_split = h.split[h.dims.index("seq")]
    if seq_split:
        raise ValueError(f"DeepSeek sparse attention (index_topk={cfg.index_topk}) with the sequence split over "
                         f"{seq_split} (context parallelism) is not supported: each query's top-k is over every "
                         f"earlier key; map no mesh axis to seq (context_parallel_size 1)")
    R = cfg.qk_rope_head_dim
    with torch.no_grad():
        q = ops.einsum("batch seq q_rank, q_rank index_head index_dim -> batch seq index_head index_dim", q_latent,
                       a["indexer_wq_b"])
        k = ops.einsum("batch seq hidden, hidden index_dim -> batch seq index_dim", h, a["indexer_wk"])
        k = ops.layer_norm(k, a["indexer_k_norm"], a["indexer_k_norm_bias"], dim=("index_dim",), eps=K_NORM_EPS)
        weights = ops.einsum("batch seq hidden, hidden index_head -> batch seq index_head", h,
                             a["indexer_weights_proj"])

        def rotated(x: Named) -> Named:
            rot = ops.rotary(ops.slice_dim(x, "index_dim", 0, R), pos, head_dim="index_dim", theta=cfg.rope_theta,
                             scaling=cfg.rope_scaling, interleaved=cfg.index_rotary_interleaved)
            return ops.concat([rot, ops.slice_dim(x, "index_dim", R, x.size("index_dim"))], "index_dim")
        qt = _local(rotated(q), ("batch", "seq", "index_head", "index_dim")).float()
        kt = _local(rotated(k), ("batch", "seq", "index_dim")).float()
        wt = _local(weights, ("batch", "seq", "index_head")).float() * cfg.index_heads ** -0.5
        scores = torch.relu(torch.matmul(qt, kt.transpose(-1, -2).unsqueeze(1)) * cfg.index_head_dim ** -0.5)
        index = torch.matmul(wt.unsqueeze(-2), scores).squeeze(-2)                  # batch seq key_seq
        n = index.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=index.device).tril()
        if segments is not None:                      # (packed rows: the keys of the query's document)
            seg = _local(segments, ("batch", "seq")).to(index.device)
            causal = causal & (seg[:, :, None] == seg[:, None, :])
        index = index.masked_fill(~causal, float("-inf"))
        best = index.topk(min(cfg.index_topk, n), dim=-1).indices
        keep = torch.zeros_like(index, dtype=torch.bool).scatter(-1, best, True)
    b_split = h.split[h.dims.index("batch")]
    return make_named(keep, ("batch", "seq", "key_seq"), (b_split, (), ()), frozenset(b_split))
