"""Multi-head latent attention (DeepSeek-V2, DeepSeek-V3, GLM-4.7-Flash; docs/models.md): the
attention of the decoder when ``Config.kv_lora_rank`` > 0, written once for every family that has it.

Keys and values come from one latent per token of ``kv_lora_rank`` entries, normed, then expanded
per head; the rotary part of the key (``qk_rope_head_dim`` entries) comes straight from the
hidden state and is shared by every head. Queries come from the hidden state (``q_proj``) or
through their own normed latent of ``q_lora_rank`` entries (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj``). Each head's q and k are ``qk_nope_head_dim`` entries without rotary followed by
``qk_rope_head_dim`` rotated ones (``Config.rotary_interleaved``: pairs (2i, 2i + 1), DeepSeek's
layout); v has ``v_head_dim`` entries. Parameters (``L`` = kv_lora_rank, ``Q`` = q_lora_rank,
``N`` heads, ``Dn + Dr`` = the q/k head, ``Dv`` the v head):

    q_proj              [H, N, Dn + Dr]  hidden heads qk_dim        (no q latent)
    q_a_proj            [H, Q]           hidden q_rank               (a q latent)
    q_a_layernorm       [Q]              q_rank
    q_b_proj            [Q, N, Dn + Dr]  q_rank heads qk_dim
    kv_a_proj_with_mqa  [H, L + Dr]      hidden kv_a                 (the latent, then the shared rotary key)
    kv_a_layernorm      [L]              kv_rank
    kv_b_proj           [L, N, Dn + Dv]  kv_rank kv_heads kv_b       (each head's k, then its v)
    o_proj              [N, Dv, H]       heads v_dim hidden

``heads`` / ``kv_heads`` split over ``tp`` as in every attention; the latents are whole. The
attention itself is :func:`functional_pp.ops.attention` (every layout, ring attention included)
with v padded with zeros to the q/k head width when it is narrower (the padding's outputs are
dropped before ``o_proj``)."""
from __future__ import annotations

import dataclasses

import torch

from functional_pp import ops
from functional_pp.models import dsa, kv_cache, temperature
from functional_pp.parallel.named import Named

__all__ = ["check_config", "init_attention", "attention", "projection_flops", "LATENT_NORM_EPS"]

LATENT_NORM_EPS = 1e-6
"""The epsilon of the two latents' RMSNorms (transformers' DeepSeek RMSNorm default, not rms_norm_eps)."""


def check_config(cfg) -> None:
    """Refuse, naming the field, a latent-attention config the decoder cannot run."""
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key}={getattr(cfg, key)} must be positive with kv_lora_rank={cfg.kv_lora_rank} "
                             f"(multi-head latent attention)")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (the rotary rotates pairs)")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank < 1:
        raise ValueError(f"q_lora_rank={cfg.q_lora_rank} must be positive or null (no q latent)")
    for key, plain in (("qkv_bias", False), ("qk_norm", False), ("sandwich_norms", False),
                       ("parallel_block", False), ("partial_rotary_factor", 1.0), ("attn_softcap", None)):
        if getattr(cfg, key) != plain:
            raise ValueError(f"{key}={getattr(cfg, key)!r} is not supported with multi-head latent attention "
                             f"(kv_lora_rank={cfg.kv_lora_rank}); it needs {plain!r}")
    if cfg.kv_heads != cfg.heads:
        raise ValueError(f"kv_heads={cfg.kv_heads} must equal heads={cfg.heads} with multi-head latent attention "
                         f"(each head expands its own k and v from the latent)")


def init_attention(cfg, w, out_std: float) -> dict:
    """The declarations of one latent attention; ``w(shape, dims, std)`` declares one weight."""
    H, N, L, R = cfg.hidden, cfg.heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + R

    def ones(shape, dims):
        return dataclasses.replace(w(shape, dims), init="ones")
    a = {}
    if cfg.q_lora_rank:
        Q = cfg.q_lora_rank
        a.update(q_a_proj=w((H, Q), "hidden q_rank"), q_a_layernorm=ones((Q,), "q_rank"),
                 q_b_proj=w((Q, N, qk), "q_rank heads qk_dim"))
    else:
        a["q_proj"] = w((H, N, qk), "hidden heads qk_dim")
    a.update(kv_a_proj_with_mqa=w((H, L + R), "hidden kv_a"), kv_a_layernorm=ones((L,), "kv_rank"),
             kv_b_proj=w((L, N, cfg.qk_nope_head_dim + cfg.v_head_dim), "kv_rank kv_heads kv_b"),
             o_proj=dataclasses.replace(w((N, cfg.v_head_dim, H), "heads v_dim hidden", out_std),
                                        meta={"in_dims": 2}))
    if cfg.index_topk:                              # DeepSeek sparse attention (models/dsa.py)
        a.update(dsa.init_indexer(cfg, w))
    if cfg.o_bias:
        a["o_bias"] = dataclasses.replace(w((H,), "hidden"), init="zeros")
    return a


def _pad(x: Named, dim: str, size: int) -> Named:
    """``x`` with ``dim`` widened to ``size`` by zeros at its end (a product with a constant)."""
    n = x.size(dim)
    if n == size:
        return x
    eye = torch.eye(n, size, dtype=x.data.dtype, device=x.data.device)
    out_dims = " ".join("pad_to" if d == dim else d for d in x.dims)
    wide = ops.einsum(f"{' '.join(x.dims)}, {dim} pad_to -> {out_dims}", x, Named(eye, (dim, "pad_to")))
    return ops.rename(wide, pad_to=dim)


def _rotate(x: Named, pos: Named, cfg) -> Named:
    """The rotary of ``x``'s ``qk_dim`` (the rotated part of q or of the shared key)."""
    return ops.rotary(x, pos, head_dim="qk_dim", theta=cfg.rope_theta, scaling=cfg.rope_scaling,
                      interleaved=cfg.rotary_interleaved)


def attention(a: dict, h: Named, pos: Named | None, cfg, segments: Named | None = None,
              window: int | None = None) -> Named:
    """The latent attention of ``h`` (batch seq hidden, the normed input), through ``o_proj``
    (batch res_seq hidden: reduce-scattered under sequence parallelism)."""
    Dn, Dr, Dv, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        c = ops.einsum("batch seq hidden, hidden q_rank -> batch seq q_rank", h, a["q_a_proj"])
        c = ops.rms_norm(c, a["q_a_layernorm"], dim=("q_rank",), eps=LATENT_NORM_EPS)
        q = ops.einsum("batch seq q_rank, q_rank heads qk_dim -> batch seq heads qk_dim", c, a["q_b_proj"])
    else:
        q = ops.einsum("batch seq hidden, hidden heads qk_dim -> batch seq heads qk_dim", h, a["q_proj"])
    kv = ops.einsum("batch seq hidden, hidden kv_a -> batch seq kv_a", h, a["kv_a_proj_with_mqa"])
    latent = ops.rms_norm(ops.slice_dim(kv, "kv_a", 0, L, into="kv_rank"), a["kv_a_layernorm"], dim=("kv_rank",),
                          eps=LATENT_NORM_EPS)
    k_rot = ops.slice_dim(kv, "kv_a", L, L + Dr, into="qk_dim")
    kvb = ops.einsum("batch seq kv_rank, kv_rank kv_heads kv_b -> batch seq kv_heads kv_b", latent, a["kv_b_proj"])
    q_pass, q_rot = ops.slice_dim(q, "qk_dim", 0, Dn), ops.slice_dim(q, "qk_dim", Dn, Dn + Dr)
    if pos is not None:
        q_rot, k_rot = _rotate(q_rot, pos, cfg), _rotate(k_rot, pos, cfg)
    q = ops.concat([q_pass, q_rot], "qk_dim")
    kept = None
    if cfg.index_topk:                              # DeepSeek sparse attention: each query's top-k keys (models/dsa.py)
        if pos is None or not cfg.q_lora_rank:
            raise ValueError("DeepSeek sparse attention (index_topk) needs rotary positions and a q latent")
        kept = dsa.kept_keys(a, h, c, pos, cfg, segments)
    if temperature.applies(cfg, pos):               # (Mistral Small 4: every layer's queries scaled by position)
        q = temperature.scale_queries(q, pos, cfg)
    # the shared rotary key, one copy per head (a product with a constant of ones over kv_heads)
    every_head = Named(torch.ones(cfg.kv_heads, dtype=k_rot.data.dtype, device=k_rot.data.device), ("kv_heads",))
    k = ops.concat([ops.slice_dim(kvb, "kv_b", 0, Dn, into="qk_dim"), k_rot * every_head], "qk_dim")
    v = ops.slice_dim(kvb, "kv_b", Dn, Dn + Dv, into="qk_dim")
    width = max(Dn + Dr, Dv)                        # (zeros added to q and k leave the scores as they are)
    q, k, v = _pad(q, "qk_dim", width), _pad(k, "qk_dim", width), _pad(v, "qk_dim", width)
    scale = (cfg.query_pre_attn_scalar or (Dn + Dr)) ** -0.5
    causal, cache, kv_segments = cfg.causal, kv_cache.active(), None
    if cache is not None:                           # sampling: the cached keys first (kv_cache.py)
        if kept is not None:
            raise ValueError("DeepSeek sparse attention (index_topk) with a key / value cache is not supported yet")
        k, v, causal, segments, kv_segments, window = cache.extend(k, v, segments, window)
    o = ops.attention(q, k, v, causal=causal, segments=segments, window=window, scale=scale, batch="batch",
                      seq="seq", heads="heads", kv_heads="kv_heads", head_dim="qk_dim", kv_segments=kv_segments,
                      kept_keys=kept)
    o = ops.slice_dim(o, "qk_dim", 0, Dv, into="v_dim") if width != Dv else ops.rename(o, qk_dim="v_dim")
    out = ops.einsum("batch seq heads v_dim, heads v_dim hidden -> batch seq hidden", o, a["o_proj"])
    out = ops.rename(out, seq="res_seq")            # sequence parallelism: reduce-scatter
    if kept is not None:                            # (the indexer's gradient: zeros, models/dsa.py)
        out = out + dsa.zero_of_indexer(a)
    return out + a["o_bias"] if "o_bias" in a else out


def projection_flops(cfg) -> float:
    """Forward FLOPs per token of one latent attention's projections."""
    H, N, L, R = cfg.hidden, cfg.heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + R
    q = H * cfg.q_lora_rank + cfg.q_lora_rank * N * qk if cfg.q_lora_rank else H * N * qk
    return 2.0 * (q + H * (L + R) + L * N * (cfg.qk_nope_head_dim + cfg.v_head_dim) + N * cfg.v_head_dim * H)
