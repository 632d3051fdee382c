"""Attention temperature tuning of the queries, written once for every attention of the decoder
(models/llama.py's, models/mla.py's latent one): Llama 4's NoPE layers (offset 1), Ministral 3's
and Mistral Small 4's every layer (offset 0, transformers' ``get_llama_4_attn_scale``). Each query
is multiplied by ``1 + scale * log1p(floor((pos + offset) / floor))`` of its position; the
``Config`` fields ``attn_temperature_floor`` (None: off), ``attn_temperature_scale``,
``attn_temperature_offset`` and ``attn_temperature_all_layers`` choose it."""
from __future__ import annotations

import torch

from functional_pp import ops
from functional_pp.models import kv_cache
from functional_pp.parallel.named import Named

__all__ = ["applies", "scale_queries"]


def applies(cfg, pos: Named | None) -> bool:
    """Whether a layer's queries are scaled: every layer (``attn_temperature_all_layers``) or the
    NoPE layers (``pos`` None) when ``attn_temperature_floor`` is set."""
    return cfg.attn_temperature_floor is not None and (pos is None or cfg.attn_temperature_all_layers)


def scale_queries(q: Named, pos: Named | None, cfg) -> Named:
    """``q`` times ``log1p(floor((pos + offset) / floor)) * scale + 1`` of each query's position
    ``pos`` (None: a NoPE layer's, from the sequence)."""
    if pos is None:
        if kv_cache.active() is not None:
            raise ValueError("sampling with a key / value cache does not support attention temperature tuning of "
                             "NoPE layers yet (attn_temperature_floor)")
        pos = ops.positions("seq", q.size("seq"), device=q.data.device)
    t = (torch.log1p(torch.floor((pos.data.float() + cfg.attn_temperature_offset) / cfg.attn_temperature_floor))
         * cfg.attn_temperature_scale + 1)
    return (q * Named(t, list(pos.dims), list(pos.split))).astype(q.data.dtype)
