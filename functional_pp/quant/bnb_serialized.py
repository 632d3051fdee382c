"""bitsandbytes' serialized 4-bit weights (what ``save_pretrained`` of a model loaded with
``BitsAndBytesConfig(load_in_4bit=True)`` writes, as pre-quantized hub checkpoints hold them):
``{name}`` uint8 ``[numel / 2, 1]`` (two codes a byte, the even entry in the high nibble),
``{name}.absmax`` (float32, one per block of the flattened weight; with double quantization its
uint8 codes beside ``nested_absmax`` / ``nested_quant_map``), ``{name}.quant_map`` (the 16 code
values) and ``{name}.quant_state.bitsandbytes__nf4`` (JSON bytes: quant_type, blocksize, dtype,
shape, nested_blocksize, nested_offset). Read by dequantizing, as bitsandbytes'
``dequantize_4bit`` does (float32 products, then the weight's dtype)."""
from __future__ import annotations

import json

import torch

from functional_pp.quant.blockwise import dequantize_flat, unpack_4bit

__all__ = ["STATE_SUFFIX", "COMPONENTS", "read_state", "dequantize_bnb4"]

#: the suffix of the quant-state entry of a serialized 4-bit weight, by quant type
STATE_SUFFIX = {"nf4": ".quant_state.bitsandbytes__nf4", "fp4": ".quant_state.bitsandbytes__fp4"}
#: the component entries beside a serialized 4-bit weight (double quantization's nested ones optional)
COMPONENTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_state(raw: torch.Tensor, where: str) -> dict:
    """The quant state's JSON (a uint8 tensor of its bytes), checked: nf4, a known dtype, a shape."""
    try:
        state = json.loads(bytes(raw.tolist()).decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: the bitsandbytes quant state is not JSON: {exc}") from exc
    if state.get("quant_type") != "nf4":
        raise ValueError(f"{where}: bitsandbytes quant_type {state.get('quant_type')!r} is not supported (NF4 "
                         f"checkpoints only: bnb_4bit_quant_type='nf4')")
    if state.get("dtype") not in _DTYPES or not isinstance(state.get("shape"), list):
        raise ValueError(f"{where}: the bitsandbytes quant state needs a dtype ({', '.join(_DTYPES)}) and a shape, "
                         f"got {state}")
    return state


def dequantize_bnb4(packed: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, state: dict,
                    nested_absmax: torch.Tensor | None = None,
                    nested_quant_map: torch.Tensor | None = None) -> torch.Tensor:
    """The weight (``state['shape']``, ``state['dtype']``) a serialized 4-bit weight stands for:
    the scales (double quantization: ``nested_quant_map[absmax] * nested_absmax`` per block of
    ``nested_blocksize``, plus ``nested_offset``), then ``quant_map[code] * scale`` per block."""
    shape, dtype, block = tuple(state["shape"]), _DTYPES[state["dtype"]], int(state["blocksize"])
    numel = 1
    for n in shape:
        numel *= n
    codes = unpack_4bit(packed.reshape(-1))[:numel]
    if absmax.dtype == torch.uint8:
        if nested_absmax is None or nested_quant_map is None:
            raise ValueError("dequantize_bnb4: uint8 absmax (double quantization) needs nested_absmax and "
                             "nested_quant_map")
        absmax = dequantize_flat(absmax, nested_absmax.float(), nested_quant_map.float(),
                                 int(state["nested_blocksize"])) + float(state["nested_offset"])
    return dequantize_flat(codes, absmax.float(), quant_map.float(), block).reshape(shape).to(dtype)
