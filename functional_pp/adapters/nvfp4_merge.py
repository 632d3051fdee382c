"""Merge-aware NVFP4 LoRA (Axolotl's ``nvfp4_merge_aware``) on whole tensors: the merged weight
``Q(W + scale A B)`` a merged export writes, equal to what training's forward computed
(``LoraWeight`` with ``nvfp4``: ``ops.fake_quant.snap_nvfp4``), and the per-tensor scale of each
adapted weight (docs/adapters.md "Merge-aware NVFP4").

A weight here has our layout, its input dimensions first (``lora_A``'s but the rank) and then its
output dimensions, an expert stack with ``experts`` before both: Hugging Face's ``[out, in]`` is
its transpose, whose rows hold NVFP4's blocks of 16 input features.

The per-tensor scale is the base checkpoint's stored ``weight_scale_2`` where the caller has it
(``checkpoint.hf.nvfp4_stored_scales``, as Axolotl uses it), else computed from the base weight."""
from __future__ import annotations

import math

import torch

from functional_pp.quant.fp4 import nvfp4_per_tensor_scale, nvfp4_round_trip

__all__ = ["per_tensor_scale", "snapped", "hf_rows"]


def hf_rows(w: torch.Tensor, in_ndim: int, per_expert: bool) -> torch.Tensor:
    """``w`` as Hugging Face's rows ``[(experts x) out, in]`` (a copy)."""
    lead = w.shape[:1] if per_expert else ()
    inner = w.shape[len(lead):]
    n_in, n_out = math.prod(inner[:in_ndim]), math.prod(inner[in_ndim:])
    return w.reshape(*lead, n_in, n_out).transpose(-1, -2).reshape(-1, n_in).contiguous()


def per_tensor_scale(base: torch.Tensor, per_expert: bool) -> torch.Tensor:
    """The NVFP4 per-tensor scale of the frozen ``base`` (torchao's ``per_tensor_amax_to_scale`` of
    its largest magnitude): 0-dim, or one per expert ([E])."""
    a = base.detach().abs()
    return nvfp4_per_tensor_scale(a.flatten(1).amax(1) if per_expert else a.amax())


def snapped(base: torch.Tensor, merged: torch.Tensor, in_ndim: int, per_expert: bool,
            scale: torch.Tensor | None = None) -> torch.Tensor:
    """``merged`` (``W + scale A B`` of ``base``) through NVFP4 and back with the per-tensor ``scale``
    (0-dim, or [E]: a checkpoint's stored ``weight_scale_2``; None: :func:`per_tensor_scale` of
    ``base``), blocks of 16 input features, in ``merged``'s layout and dtype."""
    rows = hf_rows(merged, in_ndim, per_expert)
    pts = per_tensor_scale(base, per_expert) if scale is None else scale.to(torch.float32)
    pts = pts.repeat_interleave(rows.shape[0] // pts.shape[0]).reshape(-1, 1) if per_expert else pts
    back = nvfp4_round_trip(rows, pts)
    lead = merged.shape[:1] if per_expert else ()
    inner = merged.shape[len(lead):]
    n_in, n_out = math.prod(inner[:in_ndim]), math.prod(inner[in_ndim:])
    return back.reshape(*lead, n_out, n_in).transpose(-1, -2).reshape(merged.shape).contiguous()
