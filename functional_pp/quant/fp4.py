"""FP4 (E2M1) formats: MXFP4, the form gpt-oss's checkpoints store their experts in (OCP
microscaling: 32 E2M1 values sharing a power-of-two E8M0 scale), read by dequantizing; and
NVFP4, NVIDIA's (16 E2M1 values sharing an E4M3 scale, times one fp32 scale per tensor), whose
round trip QAT's ``nvfp4`` fake quantization is (docs/quantization.md)."""
from __future__ import annotations

import torch

__all__ = ["E2M1", "dequantize_mxfp4", "dequantize_nvfp4", "round_to_e2m1", "nvfp4_per_tensor_scale",
           "nvfp4_round_trip", "quantize_nvfp4", "NVFP4_BLOCK"]

#: the values of the 16 E2M1 codes (sign bit 3), as transformers' ``FP4_VALUES``
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAGNITUDES = E2M1[:8]
_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
#: NVFP4's block: 16 consecutive entries of the last dimension share an E4M3 scale
NVFP4_BLOCK = 16


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``[..., G * 32]`` of MXFP4 ``blocks`` (uint8 ``[..., G, 16]``, two codes a byte,
    the even entry in the low nibble) with ``scales`` (uint8 ``[..., G]``, E8M0: ``2 ** (s - 127)``),
    as transformers' ``convert_moe_packed_tensors`` computes them, before its transpose."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4: blocks uint8 [..., G, 16] and scales uint8 [..., G] expected, got blocks "
                         f"{blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} {tuple(scales.shape)}")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=torch.float32, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return out.flatten(-2)


def dequantize_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, per_tensor_scale: torch.Tensor) -> torch.Tensor:
    """The float32 ``[..., K]`` of NVFP4 ``packed`` codes (uint8 ``[..., K / 2]``, the even entry in
    the low nibble) with ``block_scales`` (float8_e4m3fn ``[..., K / 16]``) and the fp32
    ``per_tensor_scale``: ``code * (block_scale * per_tensor_scale)``, as torchao's
    ``NVFP4Tensor.dequantize`` (ModelOpt's checkpoints: ``weight``, ``weight_scale``, ``weight_scale_2``)."""
    k = packed.shape[-1] * 2
    if (packed.dtype != torch.uint8 or block_scales.dtype != torch.float8_e4m3fn
            or block_scales.shape != (*packed.shape[:-1], k // NVFP4_BLOCK) or per_tensor_scale.numel() != 1):
        raise ValueError(f"NVFP4: codes uint8 [..., K/2], block scales float8_e4m3fn [..., K/16] and one fp32 scale "
                         f"expected, got {packed.dtype} {tuple(packed.shape)}, {block_scales.dtype} "
                         f"{tuple(block_scales.shape)} and {tuple(per_tensor_scale.shape)}")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    codes = torch.empty(*packed.shape[:-1], k, dtype=torch.float32, device=packed.device)
    codes[..., 0::2] = lut[(packed & 0x0F).long()]
    codes[..., 1::2] = lut[(packed >> 4).long()]
    scales = block_scales.to(torch.float32) * per_tensor_scale.to(torch.float32).reshape(())
    return (codes.unflatten(-1, (-1, NVFP4_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, within [-6, 6]) rounded to the nearest E2M1 value, ties to the even code
    (round-to-nearest-even of the 1-bit mantissa), the sign kept (-0.0 for small negatives)."""
    grid = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    a = x.abs().contiguous()
    i = torch.bucketize(a, mids)                 # ties go to the lower code ...
    tie = a == mids[i.clamp(max=len(mids) - 1)]
    i = i + (tie & (i % 2 == 1)).long()          # ... unless it is odd
    return torch.copysign(grid[i], x)


def nvfp4_per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 per-tensor scale of a tensor whose largest magnitude is ``amax``: ``amax / (448 * 6)``
    (torchao's ``per_tensor_amax_to_scale``: the block scales then use E4M3's whole range)."""
    return amax.to(torch.float32) / (_E4M3_MAX * _E2M1_MAX)


def _nvfp4_codes(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E2M1 values [rows, K / 16, 16] float32, block scales [rows, K / 16] float8_e4m3fn)`` of
    ``x`` [rows, K] with ``per_tensor_scale`` (0-dim, or one per row: [rows, 1]), torchao 0.18's
    ``nvfp4_quantize`` operation for operation."""
    rows, k = x.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4: the last dimension ({k}) must be a multiple of {NVFP4_BLOCK}")
    pts = per_tensor_scale.to(torch.float32)
    data = x.float().reshape(rows, -1, NVFP4_BLOCK)
    block_scale = torch.amax(data.abs(), dim=-1) / _E2M1_MAX
    tiny = torch.finfo(torch.float8_e4m3fn).tiny
    scale = torch.clamp(block_scale / pts, min=tiny, max=_E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = data * ((1.0 / pts) / scale.to(torch.float32)).unsqueeze(-1)
    return round_to_e2m1(torch.clamp(scaled, -_E2M1_MAX, _E2M1_MAX)), scale


def quantize_nvfp4(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [rows, K / 2], block scales float8_e4m3fn [rows, K / 16])`` of ``x`` [rows, K]
    in NVFP4 with the fp32 ``per_tensor_scale`` (0-dim, or [rows, 1]): ModelOpt's ``weight`` and
    ``weight_scale`` (``weight_scale_2`` is the per-tensor scale), bit for bit torchao 0.18's
    ``nvfp4_quantize`` (block scales ``amax / 6 / per_tensor_scale`` rounded to E4M3, fresh from
    ``x``; entries times ``(1 / per_tensor_scale) / scale`` rounded to E2M1, the even entry in the
    low nibble); :func:`dequantize_nvfp4` reads them back."""
    values, scale = _nvfp4_codes(x, per_tensor_scale)
    lut = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=x.device)
    sign = torch.signbit(values).to(torch.uint8) << 3                    # (-0.0 too: code 8)
    codes = torch.searchsorted(lut, values.abs().contiguous()).to(torch.uint8) | sign
    codes = codes.reshape(x.shape)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale


def nvfp4_round_trip(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> torch.Tensor:
    """``x`` ([rows, K], K a multiple of 16) quantized to NVFP4 and dequantized, in ``x``'s dtype:
    torchao 0.18's ``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=...).dequantize()``, operation for
    operation (:func:`quantize_nvfp4`, back as ``code * (per_tensor_scale * scale)``: the values
    :func:`dequantize_nvfp4` reads from those codes and scales). ``per_tensor_scale``: 0-dim, or
    one per row ([rows, 1]: a stack of experts, one scale each)."""
    values, scale = _nvfp4_codes(x, per_tensor_scale)
    out = values * (per_tensor_scale.to(torch.float32) * scale.to(torch.float32)).unsqueeze(-1)
    return out.reshape(x.shape).to(x.dtype)
