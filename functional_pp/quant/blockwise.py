"""Blockwise absmax quantization along the last dimension.

A tensor of shape ``(..., L)`` is cut into blocks of ``block`` consecutive entries of its last
dimension (``L`` a multiple of ``block``); each block keeps its largest magnitude (``absmax``,
float32, shape ``(..., L // block)``) and each entry the index of the code-table value nearest
to ``x / absmax`` (uint8, shape ``(..., L)``). For a contiguous tensor whose last dimension is a
multiple of the block this is bitsandbytes' ``quantize_blockwise`` / ``quantize_4bit`` on the
flattened tensor, block for block. Both outputs keep the tensor's leading dimensions and every
dimension name, so a tensor sharded on any dimension but the last, or on the last in multiples
of the block, is quantized shard by shard exactly as whole (docs/quantization.md).
"""
from __future__ import annotations

import torch

from functional_pp.quant.codebooks import midpoints

__all__ = ["check_blocks", "quantize_blockwise", "dequantize_blockwise", "quantize_flat", "dequantize_flat",
           "pack_4bit", "unpack_4bit"]


def check_blocks(shape: tuple[int, ...], block: int, what: str = "tensor") -> None:
    """A ``ValueError`` unless ``shape``'s last dimension is a positive multiple of ``block``."""
    if not shape or shape[-1] % block or shape[-1] == 0:
        last = shape[-1] if shape else None
        raise ValueError(f"{what}: blockwise quantization cuts the last dimension into blocks of {block}; "
                         f"shape {tuple(shape)} has last dimension {last}, not a multiple of {block} "
                         f"(choose a block size dividing it, or keep this tensor unquantized)")


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of ``x`` (shape ``(..., L)``) with the sorted table ``code``: ``absmax``
    float32 ``(..., L // block)``; ``codes`` uint8 ``(..., L)``, the nearest table entry of
    ``clamp(x * (1 / absmax), -1, 1)`` (an all-zero block: zeros' code)."""
    check_blocks(tuple(x.shape), block)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    absmax = xb.abs().amax(dim=-1)
    scaled = torch.clamp(xb * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1), -1, 1).contiguous()
    bounds = midpoints(code.to(device=x.device, dtype=torch.float32))
    codes = torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8)
    return codes.reshape(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``code[codes] * absmax`` per block (float32), cast to ``dtype``; the inverse of
    :func:`quantize_blockwise` up to the table's resolution."""
    nblocks = absmax.shape[-1]
    block = codes.shape[-1] // nblocks
    table = code.to(device=codes.device, dtype=torch.float32)
    values = table[codes.long()].reshape(*codes.shape[:-1], nblocks, block)
    return (values * absmax.unsqueeze(-1)).reshape(codes.shape).to(dtype)


def quantize_flat(x: torch.Tensor, code: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' blockwise quantization of ``x`` as it does it for any shape: ``x`` flattened
    (row-major), cut into blocks of ``block`` consecutive entries, the last block padded with
    zeros (which change no absmax). ``(codes, absmax)``: uint8 codes of ``x.numel()`` entries
    (1-D, the padding dropped) and float32 ``absmax`` of ``ceil(numel / block)`` blocks."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    codes, absmax = quantize_blockwise(flat, code, block)
    return codes[:x.numel()], absmax


def dequantize_flat(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`quantize_flat`: 1-D values of ``codes.numel()`` entries (``codes``
    in flattened order, any shape), ``code[codes] * absmax`` of each one's block (float32
    products, then ``dtype``)."""
    flat = codes.reshape(-1)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if flat.numel() != absmax.numel() * block:
        raise ValueError(f"dequantize_flat: {codes.numel()} codes need {flat.numel() // block} scales of blocks "
                         f"of {block}, not {absmax.numel()}")
    return dequantize_blockwise(flat, absmax.reshape(-1), code, dtype)[:codes.numel()]


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dimension (even position in the high nibble, as
    bitsandbytes): uint8 ``(..., L // 2)``."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_4bit: the last dimension ({codes.shape[-1]}) must be even")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] << 4) | c[..., 1::2]


def unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    """The codes :func:`pack_4bit` packed: uint8 ``(..., 2 * L)``."""
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
