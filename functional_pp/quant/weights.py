"""Quantized frozen weights: NF4 (QLoRA's 4-bit NormalFloat, with bitsandbytes' double
quantization of the scales) and int8 blockwise absmax, as a pytree of plain tensors that keep
the weight's dimension order (docs/quantization.md "Quantized frozen weights").

Blocks run along one dimension of the weight, its *block dimension*: the innermost input
feature of the Hugging Face weight (``in_features``), so that the blocks are bitsandbytes'
blocks of that weight. Every component has the weight's dimensions in the weight's order, with
the block dimension counted in its own unit, so the rules shard each component as they shard
the weight:

* ``codes``: NF4, two 4-bit codes per byte along the block dimension (uint8, that dimension
  halved); int8, one signed code per entry (int8, the weight's shape);
* ``absmax``: one scale per block (float32, the block dimension divided by the block); with
  double quantization the scales' 8-bit codes (uint8) instead;
* ``absmax2``, ``offset``: double quantization only: the scales of the scales (float32, one per
  block of 256 along the last dimension of ``absmax``) and the mean the scales were centred on
  (a 0-dim float32, replicated); None otherwise.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from functional_pp.quant.blockwise import check_blocks, dequantize_blockwise, pack_4bit, quantize_blockwise, unpack_4bit
from functional_pp.quant.codebooks import dynamic_map, nf4_table

__all__ = ["QuantizedWeight", "quantize_nf4", "quantize_int8", "dequantize", "NF4_BLOCK", "INT8_BLOCK",
           "SCALE_BLOCK", "quantized_bytes"]

NF4_BLOCK = 64        # bitsandbytes' default blocksize of quantize_4bit (QLoRA)
INT8_BLOCK = 64
SCALE_BLOCK = 256     # bitsandbytes' block of the double-quantized scales (bnb_4bit_use_double_quant)


class QuantizedWeight(NamedTuple):
    """A frozen weight stored quantized (module docstring). The format, the block dimension and
    the block follow from the components' shapes and dtypes: NF4 when ``codes`` is uint8, int8
    when it is int8; the block dimension is the one where ``codes`` and ``absmax`` differ."""

    codes: torch.Tensor
    absmax: torch.Tensor
    absmax2: Optional[torch.Tensor] = None
    offset: Optional[torch.Tensor] = None

    @property
    def kind(self) -> str:
        return "nf4" if self.codes.dtype == torch.uint8 else "int8"

    @property
    def block_dim(self) -> int:
        diff = [i for i, (a, b) in enumerate(zip(self.codes.shape, self.absmax.shape)) if a != b]
        if len(diff) != 1:
            raise ValueError(f"a quantized weight's codes {tuple(self.codes.shape)} and scales "
                             f"{tuple(self.absmax.shape)} must differ in exactly their block dimension")
        return diff[0]

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's (local) shape."""
        shape = list(self.codes.shape)
        if self.kind == "nf4":
            shape[self.block_dim] *= 2
        return tuple(shape)

    @property
    def block(self) -> int:
        d = self.block_dim
        return self.shape[d] // self.absmax.shape[d]


def _blocks_last(w: torch.Tensor, dim: int, block: int, what: str) -> torch.Tensor:
    moved = w.movedim(dim, -1)
    check_blocks(tuple(moved.shape), block, f"{what} (block dimension {dim} of shape {tuple(w.shape)})")
    return moved


def _double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitsandbytes' ``compress_statistics``: the scales centred on their mean, quantized with the
    signed dynamic map in blocks of :data:`SCALE_BLOCK` along their last dimension (or one block
    per row when that dimension is shorter)."""
    last = absmax.shape[-1]
    block = SCALE_BLOCK if last % SCALE_BLOCK == 0 else last
    if last > SCALE_BLOCK and last % SCALE_BLOCK:
        raise ValueError(f"double quantization groups the scales in blocks of {SCALE_BLOCK} along their last "
                         f"dimension; scales of shape {tuple(absmax.shape)} have neither a multiple of "
                         f"{SCALE_BLOCK} nor fewer there (use double_quant=False)")
    offset = absmax.contiguous().reshape(-1).mean()
    codes, absmax2 = quantize_blockwise(absmax - offset, dynamic_map(signed=True), block)
    return codes, absmax2, offset


def quantize_nf4(w: torch.Tensor, block_dim: int, *, block: int = NF4_BLOCK,
                 double_quant: bool = True) -> QuantizedWeight:
    """NF4 codes of ``w`` in blocks of ``block`` along ``block_dim`` (bitsandbytes'
    ``quantize_4bit(quant_type="nf4")`` of the weight whose last dimension that is; with
    ``double_quant``, its ``compress_statistics``)."""
    dim = block_dim % w.ndim
    codes, absmax = quantize_blockwise(_blocks_last(w, dim, block, "quantize_nf4"), nf4_table(), block)
    packed = pack_4bit(codes).movedim(-1, dim)
    absmax = absmax.movedim(-1, dim)
    if not double_quant:
        return QuantizedWeight(packed.contiguous(), absmax.contiguous())
    q, absmax2, offset = _double_quantize(absmax.contiguous())
    return QuantizedWeight(packed.contiguous(), q, absmax2, offset)


def quantize_int8(w: torch.Tensor, block_dim: int, *, block: int = INT8_BLOCK) -> QuantizedWeight:
    """int8 codes ``round(127 * w / absmax)`` in blocks of ``block`` along ``block_dim``."""
    dim = block_dim % w.ndim
    wb = _blocks_last(w, dim, block, "quantize_int8").float()
    blocks = wb.reshape(*wb.shape[:-1], wb.shape[-1] // block, block)
    absmax = blocks.abs().amax(-1)
    codes = torch.round(blocks * (127.0 / absmax.clamp(min=1e-38)).unsqueeze(-1)).clamp(-127, 127)
    return QuantizedWeight(codes.to(torch.int8).reshape(wb.shape).movedim(-1, dim).contiguous(),
                           absmax.movedim(-1, dim).contiguous())


def scales(q: QuantizedWeight) -> torch.Tensor:
    """The per-block scales (float32), undoing double quantization."""
    if q.absmax.dtype == torch.uint8:
        return dequantize_blockwise(q.absmax, q.absmax2, dynamic_map(signed=True)) + q.offset
    return q.absmax


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``q`` stands for (fp32 products, as bitsandbytes' dequantize, then ``dtype``)."""
    dim = q.block_dim
    absmax = scales(q).movedim(dim, -1)
    if q.kind == "nf4":
        codes = unpack_4bit(q.codes.movedim(dim, -1))
        values = dequantize_blockwise(codes, absmax, nf4_table())
    else:
        c = q.codes.movedim(dim, -1).float()
        nb = absmax.shape[-1]
        values = (c.reshape(*c.shape[:-1], nb, -1) * (absmax / 127.0).unsqueeze(-1)).reshape(c.shape)
    return values.movedim(-1, dim).to(dtype).contiguous()     # laid out as the weight itself


def quantized_bytes(q: QuantizedWeight) -> int:
    """Bytes of the components (what FSDP stores and all-gathers)."""
    return sum(t.numel() * t.element_size() for t in q if isinstance(t, torch.Tensor))
