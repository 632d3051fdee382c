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

That *blocked* form needs whole blocks along the block dimension. Any other weight (o_proj with
a ``head_dim`` of 16 or 96, an ``in_features`` that 64 does not divide, scales whose double
quantization cannot group them along their last dimension) takes the *flat* form, which is
bitsandbytes' own for every shape: the Hugging Face weight ``[out, in]`` flattened row-major,
blocks of :data:`FLAT_BLOCK` consecutive entries over the whole tensor, the last one padded:

* ``codes``: the weight's dimensions in the weight's order (NF4: packed two a byte along the
  *last* dimension, which must be even; int8: the weight's shape), so it shards as the weight;
* ``absmax``: 1-D, one scale per block of the flattened ``[out, in]`` weight (with double
  quantization its uint8 codes); ``absmax2``: 1-D, one per block of 256 scales (last padded);
  ``offset`` 0-dim. These do not follow the weight's dimensions: they are replicated.

A flat weight is recognised by ``absmax`` having fewer dimensions than ``codes``. Its entry order
depends on which leading dimensions are the input features, which its shapes do not say:
:func:`dequantize` takes ``block_dim`` (the innermost input dimension, as for the blocked form)
for it; inside the ops it is read from ``absmax``'s dimension name (:data:`FLAT_BLOCKS`).

A stack of weights (the experts' ``experts hidden mlp``, Hugging Face ``[experts, out, in]``)
has ``lead`` leading *batch* dimensions that stay first in the Hugging Face order: bitsandbytes
quantizes the stacked tensor flattened row-major, each expert's ``[out, in]`` after the last
(Axolotl's ``quantize_moe_experts``). Its scales' name carries the batch dimensions' names after
:data:`FLAT_LEAD` (``qblocks_of_hidden@experts``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from functional_pp.quant.blockwise import (check_blocks, dequantize_blockwise, dequantize_flat, pack_4bit,
                                           quantize_blockwise, quantize_flat, unpack_4bit)
from functional_pp.quant.codebooks import dynamic_map, nf4_table

__all__ = ["QuantizedWeight", "quantize_nf4", "quantize_int8", "dequantize", "NF4_BLOCK", "INT8_BLOCK",
           "SCALE_BLOCK", "FLAT_BLOCK", "quantized_bytes", "blocked_fits", "hf_order", "from_hf_order",
           "FLAT_BLOCKS", "FLAT_SCALES", "FLAT_LEAD", "flat_block_dim", "flat_lead"]

NF4_BLOCK = 64        # bitsandbytes' default blocksize of quantize_4bit (QLoRA)
INT8_BLOCK = 64
SCALE_BLOCK = 256     # bitsandbytes' block of the double-quantized scales (bnb_4bit_use_double_quant)
FLAT_BLOCK = 64       # the block of the flat form (bitsandbytes' default, NF4 and int8 alike)


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
    def flat(self) -> bool:
        """Whether this is the flat form (module docstring): ``absmax`` has fewer dimensions."""
        return self.absmax.ndim < self.codes.ndim

    @property
    def block_dim(self) -> int:
        if self.flat:
            raise ValueError("a flat quantized weight does not carry its block dimension in its shapes: "
                             "pass block_dim (the innermost input dimension) to dequantize")
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
            shape[-1 if self.flat else self.block_dim] *= 2
        return tuple(shape)

    @property
    def block(self) -> int:
        if self.flat:
            return FLAT_BLOCK
        d = self.block_dim
        return self.shape[d] // self.absmax.shape[d]


#: a flat weight's ``absmax`` (the flat form, module docstring) is one dimension named this prefix
#: plus the weight's block dimension (``qblocks_of_head_dim``): no rule splits it (the scales are
#: replicated), and the name tells the op which of the weight's dimensions are its input features
FLAT_BLOCKS = "qblocks_of_"
#: the dimension of a flat weight's ``absmax2`` (double quantization), replicated too
FLAT_SCALES = "qscales"
#: separates a flat stack's block dimension from its batch dimensions in its scales' name
FLAT_LEAD = "@"


def flat_block_dim(weight_dims: tuple[str, ...], absmax_dims: tuple[str, ...]) -> int:
    """The block dimension (index into ``weight_dims``) of a flat weight whose ``absmax`` has the
    dimension names ``absmax_dims`` (:data:`FLAT_BLOCKS` plus the block dimension's name)."""
    if len(absmax_dims) != 1 or not absmax_dims[0].startswith(FLAT_BLOCKS):
        raise ValueError(f"a flat quantized weight's scales are named ('{FLAT_BLOCKS}<block dimension>',), "
                         f"not {absmax_dims}")
    name = absmax_dims[0][len(FLAT_BLOCKS):].partition(FLAT_LEAD)[0]
    if name not in weight_dims:
        raise ValueError(f"a flat quantized weight's block dimension {name!r} is not one of {weight_dims}")
    return weight_dims.index(name)


def flat_lead(weight_dims: tuple[str, ...], absmax_dims: tuple[str, ...]) -> int:
    """The number of leading batch dimensions (a stack of experts) of a flat weight whose scales
    are named ``absmax_dims`` (the names after :data:`FLAT_LEAD`; 0 without)."""
    lead = absmax_dims[0].partition(FLAT_LEAD)[2] if absmax_dims else ""
    names = tuple(lead.split(",")) if lead else ()
    if names != tuple(weight_dims[:len(names)]):
        raise ValueError(f"a flat quantized stack's batch dimensions {names} are not the leading dimensions of "
                         f"{weight_dims}")
    return len(names)


def flat_scale_name(block_name: str, lead_names: tuple[str, ...] = ()) -> str:
    """The dimension name of a flat weight's scales (:data:`FLAT_BLOCKS`, :data:`FLAT_LEAD`)."""
    return FLAT_BLOCKS + block_name + (FLAT_LEAD + ",".join(lead_names) if lead_names else "")


def _blocks_last(w: torch.Tensor, dim: int, block: int, what: str) -> torch.Tensor:
    moved = w.movedim(dim, -1)
    check_blocks(tuple(moved.shape), block, f"{what} (block dimension {dim} of shape {tuple(w.shape)})")
    return moved


def _double_grouping(last: int) -> int | None:
    """The block of the blocked form's double quantization for scales whose last dimension is
    ``last``: 256, or one block per row when shorter; None when neither fits."""
    if last % SCALE_BLOCK == 0:
        return SCALE_BLOCK
    return last if last < SCALE_BLOCK else None


def blocked_fits(shape: tuple[int, ...], block_dim: int, block: int, double_quant: bool = False) -> bool:
    """Whether a weight of ``shape`` has the blocked form: whole blocks of ``block`` along
    ``block_dim`` and, with ``double_quant``, scales that group along their last dimension."""
    dim = block_dim % len(shape)
    if shape[dim] == 0 or shape[dim] % block:
        return False
    scales = list(shape)
    scales[dim] //= block
    return not double_quant or _double_grouping(scales[-1]) is not None


def hf_order(w: torch.Tensor, block_dim: int, lead: int = 0) -> torch.Tensor:
    """``w`` (input dimensions ``lead..block_dim`` first after ``lead`` batch dimensions, as the
    functional layout stores weights) permuted to the Hugging Face weight's entry order: batch
    dimensions, then output dimensions, then input. Flattened, this is the ``[out, in]`` weight
    (each of a stack's, one after the other) flattened row-major (a view)."""
    dim = block_dim % w.ndim
    return w.permute(*range(lead), *range(dim + 1, w.ndim), *range(lead, dim + 1))


def from_hf_order(t: torch.Tensor, block_dim: int, lead: int = 0) -> torch.Tensor:
    """The inverse of :func:`hf_order` (``block_dim`` counted in the weight's own order)."""
    dim = block_dim % t.ndim
    k = t.ndim - dim - 1                   # the number of output dimensions, after the batch ones in t
    return t.permute(*range(lead), *range(lead + k, t.ndim), *range(lead, lead + k))


def _double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitsandbytes' ``compress_statistics``: the scales centred on their mean, quantized with the
    signed dynamic map in blocks of :data:`SCALE_BLOCK` along their last dimension (or one block
    per row when that dimension is shorter)."""
    block = _double_grouping(absmax.shape[-1])
    if block is None:
        raise ValueError(f"double quantization groups the scales in blocks of {SCALE_BLOCK} along their last "
                         f"dimension; scales of shape {tuple(absmax.shape)} have neither a multiple of "
                         f"{SCALE_BLOCK} nor fewer there (use double_quant=False)")
    offset = absmax.contiguous().reshape(-1).mean()
    codes, absmax2 = quantize_blockwise(absmax - offset, dynamic_map(signed=True), block)
    return codes, absmax2, offset


def _flat_double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``compress_statistics`` of 1-D scales, exactly as bitsandbytes: mean, then blocks of 256
    over them, the last padded."""
    offset = absmax.mean()
    codes, absmax2 = quantize_flat(absmax - offset, dynamic_map(signed=True), SCALE_BLOCK)
    return codes, absmax2, offset


def _choose_flat(w: torch.Tensor, dim: int, block: int, double_quant: bool, flat: bool | None, what: str,
                 lead: int = 0) -> bool:
    """Whether ``w`` takes the flat form: as asked, else when the blocked form does not fit (a
    stack, ``lead`` batch dimensions, always does)."""
    if lead and flat is False:
        raise ValueError(f"{what}: a stack of weights (lead={lead}) has the flat form only")
    if not 0 <= lead <= dim:
        raise ValueError(f"{what}: lead={lead} batch dimensions must come before the block dimension {dim}")
    use = True if lead else not blocked_fits(tuple(w.shape), dim, block, double_quant) if flat is None else flat
    if use and block != FLAT_BLOCK:
        raise ValueError(f"{what}: shape {tuple(w.shape)} has no whole blocks of {block} along dimension {dim}; "
                         f"the flat form (bitsandbytes' layout for any shape) uses blocks of {FLAT_BLOCK}")
    if use and w.ndim < 2:
        raise ValueError(f"{what}: the flat form is for weights of 2 or more dimensions, not shape {tuple(w.shape)}")
    return use


def quantize_nf4(w: torch.Tensor, block_dim: int, *, block: int = NF4_BLOCK,
                 double_quant: bool = True, flat: bool | None = None, lead: int = 0) -> QuantizedWeight:
    """NF4 codes of ``w`` (bitsandbytes' ``quantize_4bit(quant_type="nf4")`` of the Hugging Face
    weight whose innermost input dimension ``block_dim`` is; with ``double_quant``, its
    ``compress_statistics``): the blocked form, in blocks of ``block`` along ``block_dim``, where
    it fits, else the flat form (module docstring; ``flat`` forces either; a stack of ``lead``
    batch dimensions, the experts', takes the flat form of the stacked Hugging Face tensor)."""
    dim = block_dim % w.ndim
    if _choose_flat(w, dim, block, double_quant, flat, "quantize_nf4", lead):
        if w.shape[-1] % 2:
            raise ValueError(f"quantize_nf4: shape {tuple(w.shape)}: the flat form packs two 4-bit codes a byte "
                             f"along the last dimension, which must be even")
        hf = hf_order(w, dim, lead)
        codes, absmax = quantize_flat(hf, nf4_table(), FLAT_BLOCK)
        packed = pack_4bit(from_hf_order(codes.reshape(hf.shape), dim, lead)).contiguous()
        if not double_quant:
            return QuantizedWeight(packed, absmax)
        return QuantizedWeight(packed, *_flat_double_quantize(absmax))
    codes, absmax = quantize_blockwise(_blocks_last(w, dim, block, "quantize_nf4"), nf4_table(), block)
    packed = pack_4bit(codes).movedim(-1, dim)
    absmax = absmax.movedim(-1, dim)
    if not double_quant:
        return QuantizedWeight(packed.contiguous(), absmax.contiguous())
    q, absmax2, offset = _double_quantize(absmax.contiguous())
    return QuantizedWeight(packed.contiguous(), q, absmax2, offset)


def _int8_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of float32 ``blocks`` (``(..., block)``): ``round(127 x / absmax)``."""
    absmax = blocks.abs().amax(-1)
    codes = torch.round(blocks * (127.0 / absmax.clamp(min=1e-38)).unsqueeze(-1)).clamp(-127, 127)
    return codes.to(torch.int8), absmax


def quantize_int8(w: torch.Tensor, block_dim: int, *, block: int = INT8_BLOCK,
                  flat: bool | None = None, lead: int = 0) -> QuantizedWeight:
    """int8 codes ``round(127 * w / absmax)`` in blocks of ``block`` along ``block_dim`` (the
    blocked form) where they fit, else over the flattened Hugging Face weight (the flat form;
    always for a stack of ``lead`` batch dimensions)."""
    dim = block_dim % w.ndim
    if _choose_flat(w, dim, block, False, flat, "quantize_int8", lead):
        hf = hf_order(w, dim, lead).float().reshape(-1)
        pad = (-hf.numel()) % FLAT_BLOCK
        codes, absmax = _int8_blocks(torch.cat([hf, hf.new_zeros(pad)]).reshape(-1, FLAT_BLOCK))
        codes = codes.reshape(-1)[:hf.numel()].reshape(hf_order(w, dim, lead).shape)
        return QuantizedWeight(from_hf_order(codes, dim, lead).contiguous(), absmax)
    wb = _blocks_last(w, dim, block, "quantize_int8").float()
    codes, absmax = _int8_blocks(wb.reshape(*wb.shape[:-1], wb.shape[-1] // block, block))
    return QuantizedWeight(codes.reshape(wb.shape).movedim(-1, dim).contiguous(),
                           absmax.movedim(-1, dim).contiguous())


def scales(q: QuantizedWeight) -> torch.Tensor:
    """The per-block scales (float32), undoing double quantization."""
    if q.absmax.dtype == torch.uint8:
        if q.flat:
            return dequantize_flat(q.absmax, q.absmax2, dynamic_map(signed=True), SCALE_BLOCK) + q.offset
        return dequantize_blockwise(q.absmax, q.absmax2, dynamic_map(signed=True)) + q.offset
    return q.absmax


def _dequantize_flat(q: QuantizedWeight, block_dim: int | None, dtype: torch.dtype, lead: int,
                     block_scales: torch.Tensor | None) -> torch.Tensor:
    if block_dim is None:
        raise ValueError("dequantize: a flat quantized weight needs block_dim (the innermost input dimension "
                         "of the weight: models.quantize.LINEAR_BLOCK_DIMS names it)")
    codes = unpack_4bit(q.codes) if q.kind == "nf4" else q.codes
    dim = block_dim % codes.ndim
    hf = hf_order(codes, dim, lead)
    absmax = (scales(q) if block_scales is None else block_scales).reshape(-1)
    if q.kind == "nf4":
        values = dequantize_flat(hf, absmax, nf4_table(), FLAT_BLOCK)
    else:
        c = hf.reshape(-1).float()
        pad = (-c.numel()) % FLAT_BLOCK
        c = torch.cat([c, c.new_zeros(pad)]).reshape(-1, FLAT_BLOCK)
        values = (c * (absmax / 127.0).unsqueeze(-1)).reshape(-1)[:hf.numel()]
    return from_hf_order(values.reshape(hf.shape), dim, lead).to(dtype).contiguous()


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32, block_dim: int | None = None,
               lead: int = 0, block_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``q`` stands for (fp32 products, as bitsandbytes' dequantize, then ``dtype``);
    ``block_dim`` and ``lead`` (batch dimensions of a stack) are needed for (and only read for)
    the flat form. ``block_scales`` (flat form): the float32 scales of ``q.codes``' blocks,
    given where ``codes`` is a slice of the stack's experts (whose scales, double-quantized over
    the whole stack, cannot be decoded from the slice)."""
    if q.flat:
        return _dequantize_flat(q, block_dim, dtype, lead, block_scales)
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
