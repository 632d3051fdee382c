"""Code tables of blockwise quantization, as published by bitsandbytes (MIT licence,
Copyright (c) Facebook, Inc. and its affiliates; the algorithms re-written here):

* :func:`dynamic_map`: the dynamic 8-bit data type of Dettmers et al., "8-bit Optimizers via
  Block-wise Quantization" (2021): a sign, a run of zero bits giving a decimal exponent, an
  indicator bit, then a linear fraction; 256 sorted values in [-1, 1] (or [0, 1] unsigned).
  bitsandbytes' 8-bit optimizers store the first moment with the signed map and the second
  with the unsigned one.
* :data:`NF4`: the 4-bit NormalFloat table of Dettmers et al., "QLoRA" (2023): quantiles of a
  standard normal, normalised to [-1, 1], with an exact zero.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["dynamic_map", "NF4", "nf4_table", "midpoints"]


@functools.lru_cache(maxsize=None)
def _dynamic_values(signed: bool, max_exponent_bits: int, total_bits: int) -> tuple[float, ...]:
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    i = 0
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        edges = torch.linspace(0.1, 1, int(items), dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    if additional_items > 0:
        edges = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2 ** total_bits - len(data))
    return tuple(sorted(data))


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The dynamic quantization map (float32, ``2**total_bits`` sorted values): bitsandbytes'
    ``create_dynamic_map`` with the same arguments, value for value."""
    return torch.tensor(_dynamic_values(bool(signed), int(max_exponent_bits), int(total_bits)),
                        dtype=torch.float32)


# the published NF4 table (QLoRA, Appendix E; bitsandbytes' get_4bit_type("nf4")), index = 4-bit code
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0)


def nf4_table() -> torch.Tensor:
    """:data:`NF4` as a float32 tensor (16 sorted values, index = code)."""
    return torch.tensor(NF4, dtype=torch.float32)


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """The decision boundaries of a sorted code table: a value goes to the nearest entry, a
    value exactly between two to the lower one (``torch.bucketize`` with these)."""
    return (code[:-1] + code[1:]) / 2
