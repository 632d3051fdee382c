"""LoftQ initialisation of LoRA adapters (peft's ``init_lora_weights="loftq"``, Axolotl's
``peft: {loftq_config: {loftq_bits: 4}}``; docs/adapters.md "LoftQ").

For each adapted weight ``W`` (the Hugging Face ``[out, in]`` matrix), as peft's
``peft.utils.loftq_utils.loftq_init``: ``loftq_iter`` times, the residual is quantized and
dequantized (``Q``: NF4 in bitsandbytes' blocks of 64 over the flattened weight, or bitsandbytes'
row-wise int8 of the fp16 weight), and ``W - Q`` is factored by its SVD to rank ``r``
(``L = U sqrt(S)``, ``R = sqrt(S) V^T``); the base becomes ``Q`` (kept in floating point, frozen),
``lora_A = R`` and ``lora_B = L``. As in peft, the factors are not divided by the LoRA scale.

peft's own routine runs its quantization on a CUDA / XPU device only; this is the same
computation with the quantizers of ``functional_pp.quant`` (equal to bitsandbytes' on these
shapes), on whatever device holds the weight.
"""
from __future__ import annotations

from typing import Any

import torch

from functional_pp.quant.blockwise import dequantize_flat, quantize_flat
from functional_pp.quant.codebooks import nf4_table
from functional_pp.quant.weights import FLAT_BLOCK

__all__ = ["LOFTQ_BITS", "loftq_matrix", "loftq_init"]

#: the loftq_bits peft's LoftQ quantizes with (NF4, int8)
LOFTQ_BITS = (4, 8)


def _nf4_round_trip(w: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' ``Params4bit(compress_statistics=False, quant_type="nf4")`` then
    ``dequantize_4bit`` of the ``[out, in]`` fp32 ``w``."""
    codes, absmax = quantize_flat(w, nf4_table(), FLAT_BLOCK)
    return dequantize_flat(codes.reshape(w.shape), absmax, nf4_table(), FLAT_BLOCK).reshape(w.shape)


def _int8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' ``Int8Params`` (the weight in fp16, ``round(127 w / absmax)`` per row) then
    ``int8_vectorwise_dequant``."""
    half = w.to(torch.float16)
    absmax = half.abs().amax(dim=1).float()
    codes = torch.round(half * (127.0 / absmax.unsqueeze(-1))).to(torch.int8)
    return codes * absmax.view(-1, 1) * 7.874015718698502e-3


def loftq_matrix(weight: torch.Tensor, bits: int, rank: int, iters: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(base, lora_A, lora_B)`` of the Hugging Face ``[out, in]`` ``weight``: peft's
    ``loftq_init(weight, num_bits=bits, reduced_rank=rank, num_iter=iters)`` (fp32 throughout;
    ``base`` in ``weight``'s dtype, ``lora_A`` ``[rank, in]``, ``lora_B`` ``[out, rank]``)."""
    if bits not in LOFTQ_BITS:
        raise ValueError(f"loftq_bits={bits}: peft's LoftQ quantizes with 4 (NF4) or 8 (int8) bits")
    if iters < 1:
        raise ValueError(f"loftq_iter={iters}: LoftQ needs at least one iteration")
    if weight.ndim != 2:
        raise ValueError(f"LoftQ factors a matrix, not a tensor of shape {tuple(weight.shape)}")
    round_trip = _nf4_round_trip if bits == 4 else _int8_round_trip
    w = weight.to(torch.float32)
    res = w.clone()
    for i in range(iters):
        deq = round_trip(res)
        u, s, vh = torch.linalg.svd(w - deq, full_matrices=False)
        left = u @ torch.sqrt(torch.diag(s)[:, :rank])
        right = torch.sqrt(torch.diag(s)[:rank, :]) @ vh
        if i + 1 < iters:
            res = w - left @ right
    return deq.to(weight.dtype), right, left


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def loftq_init(base: dict[str, torch.Tensor], adapters: dict[str, dict], in_dims: dict[str, int], bits: int,
               iters: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """LoftQ of full (unsharded) weights in the functional layout: ``base`` ``{weight path:
    tensor}`` (``in... out...``), ``adapters`` the adapters' declarations ``{weight path:
    {"lora_A", "lora_B"}}`` (``adapters.split``), ``in_dims`` each weight's number of leading input
    dimensions. Returns ``(new weights of the adapted paths, {path: {"lora_A", "lora_B"}}``
    shaped as declared)."""
    weights, factors = {}, {}
    for path, ab in adapters.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoftQ: {path} has {sorted(ab)}: LoftQ initialises plain LoRA adapters only "
                             f"(not DoRA's magnitudes)")
        w = base[path]
        k = in_dims.get(path, 1)
        shape_a, shape_b = tuple(ab["lora_A"].shape), tuple(ab["lora_B"].shape)
        if shape_a[:-1] != tuple(w.shape[:k]) or shape_b[1:] != tuple(w.shape[k:]):
            raise ValueError(f"LoftQ: {path}: adapters {shape_a} / {shape_b} do not fit the weight "
                             f"{tuple(w.shape)} as a linear of {k} input dimension(s) (an expert stack is "
                             f"not supported)")
        hf = w.reshape(_numel(w.shape[:k]), -1).T                     # [out, in]
        q, a, b = loftq_matrix(hf, bits, shape_a[-1], iters)
        weights[path] = q.T.reshape(w.shape).contiguous()
        factors[path] = {"lora_A": a.T.reshape(shape_a).contiguous(), "lora_B": b.T.reshape(shape_b).contiguous()}
    return weights, factors


def adapted_in_dims(decls: Any, paths) -> dict[str, int]:
    """``{path: number of leading input dimensions}`` of the weights at ``paths`` (their
    declarations' ``meta["in_dims"]``, 1 by default)."""
    from functional_pp.core.tree import leaves_with_paths
    by_path = dict(leaves_with_paths(decls))
    return {p: int((getattr(by_path[p], "meta", None) or {}).get("in_dims", 1)) for p in paths}
