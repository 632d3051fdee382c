"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum, as hub repositories such as
``TheBloke/Llama-2-7B-GPTQ`` hold them), read dequantized. Per linear layer ``{prefix}``:

* ``{prefix}.qweight`` int32 ``[in * bits / 32, out]``: ``32 / bits`` codes per int32 along the
  input dimension, input row ``k * (32 / bits) + j`` in bits ``[j * bits, (j + 1) * bits)`` of row k;
* ``{prefix}.qzeros`` int32 ``[groups, out * bits / 32]``: the zero points, packed the same way
  along the output dimension;
* ``{prefix}.scales`` (fp16) ``[groups, out]``;
* ``{prefix}.g_idx`` int32 ``[in]`` (optional): the group of each input row (act-order,
  ``desc_act``, permutes it; without it, row i is in group ``i // group_size``).

The weight ``[in, out]`` is ``scales[g, o] * (code[i, o] - zero[g, o])`` with ``g = g_idx[i]``,
the product rounded once to the scales' dtype (what the GPTQ kernels compute in fp16); the
Hugging Face weight is its transpose. ``checkpoint_format: gptq`` (v1, the default) stores each
zero point minus one: the zero is the stored ``bits``-wide value plus one (a stored all-ones value
reads as ``2**bits``, as AutoGPTQ's kernels read it); ``gptq_v2`` stores the zero itself.
Bits 2, 4 and 8 are read (whole codes per int32); 3-bit packing, whose codes straddle int32s, is
refused by name."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["GPTQ_BITS", "GptqFormat", "gptq_format", "dequantize_gptq"]

#: code widths read (codes whole within an int32)
GPTQ_BITS = (2, 4, 8)
_FORMATS = ("gptq", "gptq_v2")


class GptqFormat(NamedTuple):
    """What a checkpoint's ``quantization_config`` says of its tensors."""

    bits: int
    group_size: int        # -1: one group over all input rows
    v1: bool               # checkpoint_format gptq: zero points stored minus one


def gptq_format(qc: Any, where: str) -> GptqFormat:
    """The checked :class:`GptqFormat` of ``config.json``'s ``quantization_config`` (``where``
    names the file in errors): bits 2/4/8, a group size (-1: one group), checkpoint_format
    gptq (v1) or gptq_v2."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "gptq":
        raise ValueError(f"{where}: GPTQ tensors (qweight/qzeros/scales) need quantization_config "
                         f"{{quant_method: gptq, bits, group_size, ...}}, got {qc!r}")
    bits, group = qc.get("bits"), qc.get("group_size", 128)
    if bits not in GPTQ_BITS:
        raise ValueError(f"{where}: quantization_config.bits {bits!r} is not read (GPTQ bits {GPTQ_BITS}: codes "
                         f"whole in an int32; 3-bit codes straddle int32s): use a 2-, 4- or 8-bit checkpoint")
    if isinstance(group, bool) or not isinstance(group, int) or (group < 1 and group != -1):
        raise ValueError(f"{where}: quantization_config.group_size must be a whole number >= 1 or -1 (one group "
                         f"per column), got {group!r}")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in _FORMATS:
        raise ValueError(f"{where}: quantization_config.checkpoint_format {fmt!r} is not read ({', '.join(_FORMATS)}; "
                         f"marlin / bitblas / ipex layouts are kernels' repackings: use the gptq checkpoint)")
    return GptqFormat(bits, group, fmt == "gptq")


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The ``bits``-wide codes (int32) of int32 ``packed``, ``32 / bits`` per entry along ``dim``
    (the lowest bits first)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    dim = dim % packed.ndim
    view = [1] * (packed.ndim + 1)
    view[dim + 1] = shifts.numel()
    codes = torch.bitwise_and(torch.bitwise_right_shift(packed.unsqueeze(dim + 1), shifts.view(view)),
                              (1 << bits) - 1)
    return codes.flatten(dim, dim + 1)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    fmt: GptqFormat, row0: int = 0, col0: int = 0) -> torch.Tensor:
    """The ``[in, out]`` weight (the scales' dtype) of one GPTQ linear (module docstring), or a
    block of it: ``g_idx`` holds the groups of the block's input rows and ``scales`` its output
    columns; ``qweight`` the int32s holding those rows (the first row ``row0`` codes into its
    first int32) and those columns; ``qzeros`` the int32s holding the columns (the first column
    ``col0`` codes into its first int32)."""
    n_rows, n_cols = g_idx.numel(), scales.shape[1]
    codes = _unpack(qweight, fmt.bits, 0)[row0:row0 + n_rows]                # [rows, out]
    zeros = _unpack(qzeros, fmt.bits, 1)[:, col0:col0 + n_cols]               # [groups, out]
    if fmt.v1:
        zeros = zeros + 1
    if codes.shape != (n_rows, n_cols) or zeros.shape != scales.shape:
        raise ValueError(f"dequantize_gptq: codes {tuple(codes.shape)}, zeros {tuple(zeros.shape)}, scales "
                         f"{tuple(scales.shape)} and g_idx {tuple(g_idx.shape)} do not agree")
    g = g_idx.long()
    if n_rows and (g.min() < 0 or g.max() >= scales.shape[0]):
        raise ValueError(f"dequantize_gptq: g_idx names groups {int(g.min())}..{int(g.max())} of "
                         f"{scales.shape[0]}")
    diff = (codes - zeros[g]).float()                                         # exact small integers
    return (scales[g].float() * diff).to(scales.dtype)                        # one rounding, as the fp16 kernels
