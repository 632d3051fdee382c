"""Attention on meta tensors (planning dry-runs) that records what a real flash kernel saves
for backward: q, k, v, the output and the log-sum-exp (docs/planning.md, "Attention on meta
tensors"). ``F.scaled_dot_product_attention`` falls back to the math kernel on meta tensors,
which would keep fp32 seq x seq probabilities; the CPU flash op's meta implementation has
exactly the flash autograd record, GQA included. A boolean mask becomes the additive one torch's
kernels read (``where(mask, 0, -inf)`` in the queries' dtype), as ``F.scaled_dot_product_attention``
makes it before calling a fused kernel."""
from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def flash_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s signature; flash's saved tensors."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero, neg = (torch.scalar_tensor(v, dtype=q.dtype, device=attn_mask.device) for v in (0.0, float("-inf")))
        attn_mask = torch.where(attn_mask, zero, neg)
    out, _ = _flash(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out


def sdpa_for(t: torch.Tensor):
    """The attention function for tensors like ``t``: flash-like on meta, torch's otherwise."""
    return flash_like if t.device.type == "meta" else torch.nn.functional.scaled_dot_product_attention
