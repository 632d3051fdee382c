"""Quantized frozen weights inside the named ops (docs/quantization.md "Quantized frozen
weights"): a :class:`~functional_pp.quant.weights.QuantizedWeight` whose components are named
values with the weight's dimension names. An op that uses one plans with a stand-in of the
weight's type (:func:`stand_in`), moves the *quantized* components to the layout it wants (an
FSDP all-gather moves the codes and scales, not the weight) and dequantizes there
(:func:`realize`), in the compute dtype of the other operands. A weight in the flat form
(quant/weights.py: blocks over the whole flattened Hugging Face weight, which no shard boundary
need respect) is gathered whole, dequantized, and then cut to the layout the op wants; a flat
stack of experts keeps its experts split (expert parallelism) where each expert holds whole
blocks: its codes gathered along the other dimensions only, the scales (replicated) decoded
whole and cut to this device's experts."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from functional_pp.core.layout import Layout
from functional_pp.ops.einsum import _plan, einsum, register_operand
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.named import Named, make_named, op_env, require_named, settle
from functional_pp.quant.weights import FLAT_BLOCK, QuantizedWeight, dequantize, flat_block_dim, flat_lead, scales

__all__ = ["is_quantized", "stand_in", "realize"]

_EMPTY = frozenset()


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is a quantized weight of named components."""
    return isinstance(x, QuantizedWeight) and isinstance(x.codes, Named)


def _local(q: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(*(c.data if isinstance(c, Named) else c for c in q))


def _is_flat(q: QuantizedWeight) -> bool:
    return len(q.absmax._dims) < len(q.codes._dims)


def _block_dim(q: QuantizedWeight) -> int:
    """The block dimension, from the components' global sizes (their local shapes may be laid
    out differently: an FSDP unit gathers the floating-point scales, not the integer codes); of
    a flat weight, from its scales' dimension name."""
    if _is_flat(q):
        return flat_block_dim(q.codes._dims, q.absmax._dims)
    return QuantizedWeight(torch.empty(q.codes._sizes, device="meta"),
                           torch.empty(q.absmax._sizes, device="meta")).block_dim


def _unpacked(q: QuantizedWeight, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """``sizes`` of the codes as the weight's (NF4 packs two codes a byte along the block
    dimension; the flat form along the last)."""
    out = list(sizes)
    if q.codes._data.dtype == torch.uint8:
        out[-1 if _is_flat(q) else _block_dim(q)] *= 2
    return tuple(out)


def _global_shape(q: QuantizedWeight) -> tuple[int, ...]:
    return _unpacked(q, q.codes._sizes)


def stand_in(q: QuantizedWeight) -> Named:
    """A value of the weight's type (dimensions, layout, varying axes, global sizes) on the meta
    device: what an op plans with."""
    c = q.codes
    return make_named(torch.empty(_unpacked(q, tuple(c._data.shape)), device="meta"), c._dims, c._split, c._vary,
                      _EMPTY, _global_shape(q))


def _target(c: Named, codes: Named, target: Layout) -> Layout:
    """``target`` for component ``c``: a dimension of its own (double quantization's one scale per
    row, ``models.quantize.ROW_SCALE``) stays whole."""
    if c._dims == codes._dims:
        return target
    return tuple(t if d == w else () for d, w, t in zip(c._dims, codes._dims, target))


def realize(q: QuantizedWeight, target: Layout, dtype: torch.dtype, op: str = "quantized weight") -> Named:
    """The weight in layout ``target``, dequantized to ``dtype``: each named component relaid out
    to ``target`` (the same dimension names: the same collectives, on the quantized bytes), then
    dequantized locally. Frozen: no gradient flows into it."""
    if _is_flat(q):
        return _realize_flat(q, target, dtype, op)
    moved = [relayout(c, _target(c, q.codes, target), op) if isinstance(c, Named) and c._data.ndim else c for c in q]
    local = _local(QuantizedWeight(*moved))
    codes = moved[0]
    sizes = _global_shape(q)
    return make_named(dequantize(local, dtype), codes._dims, target, codes._vary, _EMPTY, sizes)


def _realize_flat(q: QuantizedWeight, target: Layout, dtype: torch.dtype, op: str) -> Named:
    """A flat weight in layout ``target``: every component gathered whole (the codes'
    collectives move the quantized bytes), dequantized in bitsandbytes' order, then cut to
    ``target`` (a local slice, no collective). A stack whose experts hold whole blocks keeps
    ``target``'s split of its batch dimensions (:func:`_realize_stack`)."""
    lead = flat_lead(q.codes._dims, q.absmax._dims)
    sizes = _global_shape(q)
    per_expert = 1
    for s in sizes[lead:]:
        per_expert *= s
    if lead and per_expert % FLAT_BLOCK == 0:
        return _realize_stack(q, target, dtype, op, lead)
    moved = [relayout(c, tuple(() for _ in c._dims), op) if isinstance(c, Named) and c._data.ndim else c for c in q]
    codes = moved[0]
    full = dequantize(_local(QuantizedWeight(*moved)), dtype, block_dim=_block_dim(q), lead=lead)
    whole = make_named(full, codes._dims, codes._split, codes._vary, _EMPTY, sizes)
    return relayout(whole, target, op)


def _realize_stack(q: QuantizedWeight, target: Layout, dtype: torch.dtype, op: str, lead: int) -> Named:
    """A flat stack (``lead`` batch dimensions, each of its matrices whole blocks) in layout
    ``target``: the codes gathered except along the batch dimensions, which keep ``target``'s
    split; the scales (replicated) decoded whole, then cut to this device's part of the batch
    dimensions (a local slice); dequantized there, then cut to ``target``."""
    keep = tuple(t if i < lead else () for i, t in enumerate(target))
    codes = relayout(q.codes, keep, op)
    rest = [relayout(c, tuple(() for _ in c._dims), op) if isinstance(c, Named) and c._data.ndim else c for c in q[1:]]
    decoded = scales(_local(QuantizedWeight(q.codes, *rest))).float()
    sizes = _global_shape(q)
    lead_dims = codes._dims[:lead]
    per = decoded.reshape(*sizes[:lead], -1)
    whole = make_named(per, lead_dims + ("qblocks",), tuple(() for _ in range(lead + 1)), codes._vary, _EMPTY,
                  tuple(per.shape))
    mine = relayout(whole, keep[:lead] + ((),), op)
    local = dequantize(QuantizedWeight(codes._data, *(c._data if isinstance(c, Named) else c for c in rest)), dtype,
                       block_dim=_block_dim(q), lead=lead, block_scales=mine._data)
    return relayout(make_named(local, codes._dims, keep, codes._vary, _EMPTY, sizes), target, op)


def _einsum(pattern: str, operands: Sequence[Any], i: int) -> Named:
    """``einsum(pattern, *operands)`` with a quantized weight among them: each moved, quantized,
    to the layout this einsum wants of it and dequantized there, in the dtype of the first
    floating-point operand."""
    if not is_quantized(operands[i]):
        require_named(f"einsum {pattern!r}", **{f"operand {j}": x for j, x in enumerate(operands)})
    named = [settle(x) if isinstance(x, Named) and x._partial else x for x in operands]
    dtype = next((x._data.dtype for x in named if isinstance(x, Named) and x._data.is_floating_point()),
                 torch.float32)
    mesh, rules, plans = op_env()
    targets = _plan(pattern, [stand_in(x) if is_quantized(x) else x for x in named], mesh, rules, plans)[0]
    return einsum(pattern, *[realize(x, t, dtype, f"einsum {pattern!r}") if is_quantized(x) else x
                             for x, t in zip(named, targets)])


register_operand(QuantizedWeight, _einsum)
