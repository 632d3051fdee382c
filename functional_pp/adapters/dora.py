"""DoRA (Liu et al. 2024, as ``peft`` implements it): a LoRA-adapted weight ``W + s A B``
renormalised per output feature, ``y = m / ||W + s A B|| * (x W + s x A B)``, with a trained
magnitude ``m`` over the weight's output dimensions (``lora_magnitude``, initialised to the
norm at the start). The norm is taken over the input dimensions (the ones a linear contracts)
and, as peft does by default (the paper's section 4.3), detached: no gradient flows through it.

The norm is written with the named ops, so its collectives are derived like every other
op's: under TP a row-parallel weight's input dimensions are split, and the sum of squares is
a pending sum over ``tp`` completed before the square root (one all-reduce of an
output-sized vector); :func:`~functional_pp.adapters.lora.init_magnitudes` on FSDP-stored
shards reduces the same way over ``dp_shard``. A quantized base (QLoRA) is dequantized in
place for it."""
from __future__ import annotations

from typing import Any

import torch

from functional_pp.ops.einsum import einsum
from functional_pp.ops.elementwise import square
from functional_pp.ops.quantized import is_quantized, realize, stand_in
from functional_pp.ops.reduce import sum as named_sum
from functional_pp.parallel.named import Named

MAGNITUDE = "lora_magnitude"

__all__ = ["MAGNITUDE", "row_norm", "full_row_norm"]


def row_norm(weight: Any, lora_A: Named, lora_B: Named, scale: float) -> Named:
    """``||W + scale A B||`` over the input dimensions of ``weight`` (``lora_A``'s but the rank),
    per output feature (``lora_B``'s dimensions but the rank); detached (no gradient)."""
    with torch.no_grad():
        if is_quantized(weight):            # (in the layout its codes have: no collective)
            weight = realize(weight, stand_in(weight).split, lora_A.data.dtype, "DoRA weight norm")
        dims = " ".join(weight.dims)
        update = einsum(f"{' '.join(lora_A.dims)}, {' '.join(lora_B.dims)} -> {dims}", lora_A, lora_B)
        sq = named_sum(square(weight + update * scale), lora_A.dims[:-1])
        return sq.map(torch.sqrt)          # (a pending sum over split input dimensions completed first)


def full_row_norm(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`row_norm` of full tensors (``lora_A`` over ``in... r``, ``lora_B`` over ``r out...``)."""
    k = lora_A.ndim - 1
    w = weight + torch.tensordot(lora_A, lora_B, dims=([k], [0])) * scale
    return w.square().sum(dim=tuple(range(k))).sqrt()
