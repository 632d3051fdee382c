"""Attention on meta tensors (planning dry-runs) that records what a real flash kernel saves
for backward: q, k, v, the output and the log-sum-exp (docs/planning.md, "Attention on meta
tensors"). ``F.scaled_dot_product_attention`` falls back to the math kernel on meta tensors,
which would keep fp32 seq x seq probabilities; the CPU flash op's meta implementation has
exactly the flash autograd record, GQA included."""
from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def flash_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s signature; flash's saved tensors."""
    out, _ = _flash(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out


def sdpa_for(t: torch.Tensor):
    """The attention function for tensors like ``t``: flash-like on meta, torch's otherwise."""
    return flash_like if t.device.type == "meta" else torch.nn.functional.scaled_dot_product_attention
