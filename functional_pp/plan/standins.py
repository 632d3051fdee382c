"""Stand-ins that make a meta-tensor run save what the real kernels save
(docs/planning.md, "Attention on meta tensors").

On meta tensors ``scaled_dot_product_attention`` falls back to the math kernel, which keeps
fp32 seq x seq probabilities for backward. Real runs use a flash kernel (CPU flash, CUDA
flash or memory-efficient), which keeps q, k, v, the output and the log-sum-exp. The stand-in
calls the CPU flash op, whose meta implementation has exactly that autograd record."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class FlashOnMeta(TorchFunctionMode):
    """Route meta ``F.scaled_dot_product_attention`` calls through a flash-attention record."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            return _flash_like(*args, **kwargs)
        return func(*args, **kwargs)


def _flash_like(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    out, _ = _flash(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out
