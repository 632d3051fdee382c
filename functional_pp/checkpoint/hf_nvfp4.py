"""A merged export in ModelOpt's NVFP4 layout (Axolotl's ``merge-lora`` of an ``nvfp4_merge_aware``
adapter; docs/adapters.md "Merge-aware NVFP4"): each adapted Hugging Face weight ``[out, in]``
written as ``weight`` (uint8 E2M1 pairs), ``weight_scale`` (float8_e4m3fn, one per 16 inputs) and
``weight_scale_2`` (fp32, the per-tensor scale training snapped with), with base_model's
``input_scale``; every other weight base_model stores as NVFP4 copied from it unchanged (frozen,
and read from exactly those bytes); config.json keeps base_model's ``quantization_config``. The
import (checkpoint/hf.py) reads it back to the weights training computed with."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from functional_pp.checkpoint.format import CheckpointMismatchError
from functional_pp.quant.fp4 import quantize_nvfp4

__all__ = ["nvfp4_items", "nvfp4_quantization_config", "check_stored", "stored_scales"]

_SCALES = ("_scale", "_scale_2")
_DTYPES = {"U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16}


def nvfp4_quantization_config(base_model: str | Path) -> dict:
    """base_model's ``quantization_config`` (a ModelOpt NVFP4 checkpoint's), refused by name otherwise."""
    conf = Path(base_model) / "config.json"
    qc = (json.loads(conf.read_text()).get("quantization_config") or {}) if conf.is_file() else {}
    if qc.get("quant_method") != "modelopt" or qc.get("quant_algo") != "NVFP4":
        raise CheckpointMismatchError(f"nvfp4_merge_aware: the merged export writes base_model's NVFP4 layout, but "
                                      f"{conf} has no ModelOpt NVFP4 quantization_config (quant_method: modelopt, "
                                      f"quant_algo: NVFP4; found {qc or None}): train on a ModelOpt NVFP4 checkpoint "
                                      f"or without nvfp4_merge_aware")
    return qc


def _files(base: Path) -> dict[str, Path]:
    index = base / "model.safetensors.index.json"
    if index.is_file():
        return {k: base / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(str(base / "model.safetensors"), framework="pt") as h:
        return {k: base / "model.safetensors" for k in h.keys()}


def _copy(files: dict[str, Path], name: str) -> tuple:
    """A lazy item of base_model's tensor ``name``, its bits and dtype as stored."""
    with safe_open(str(files[name]), framework="pt") as h:
        sl = h.get_slice(name)
        shape, code = tuple(sl.get_shape()), sl.get_dtype()
    if code not in _DTYPES:
        raise CheckpointMismatchError(f"{files[name]}: {name} is {code}, not a dtype of a ModelOpt NVFP4 weight "
                                      f"({', '.join(_DTYPES)})")
    dtype = _DTYPES[code]

    def read(f=files[name], name=name):
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(name)
    return name, dtype, shape, read


def check_stored(base_model: str | Path, names: list[str]) -> None:
    """Refuse the first of the weights ``names`` that base_model (a ModelOpt NVFP4 checkpoint) does
    not store as NVFP4."""
    nvfp4_quantization_config(base_model)
    files = _files(Path(base_model))
    for name in names:
        if not all(name + s in files for s in _SCALES):
            raise CheckpointMismatchError(f"nvfp4_merge_aware: {name} is adapted but base_model does not store it as "
                                          f"an NVFP4 weight ({name}_scale_2 missing): target only the weights its "
                                          f"quantization_config quantizes")


def stored_scales(base_model: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """``{name: its stored per-tensor scale}`` (``{name}_scale_2``, 0-dim fp32) of the weights
    ``names`` of base_model (a ModelOpt NVFP4 checkpoint); one it does not store as NVFP4, or a
    scale that is not one positive finite number, is refused by name."""
    check_stored(base_model, names)
    files, out = _files(Path(base_model)), {}
    for name in names:
        key = name + "_scale_2"
        with safe_open(str(files[key]), framework="pt") as h:
            t = h.get_tensor(key)
        if t.numel() != 1 or not t.is_floating_point() or not (torch.isfinite(t).all() and (t > 0).all()):
            raise CheckpointMismatchError(f"{files[key]}: {key} {t.dtype} {list(t.shape)} is not one positive "
                                          f"finite per-tensor scale (ModelOpt's NVFP4 weight_scale_2)")
        out[name] = t.to(torch.float32).reshape(())
    return out


def nvfp4_items(items: list, base_model: str | Path, scales: dict[str, torch.Tensor]) -> list:
    """``items`` (``(name, dtype, shape, make)``, Hugging Face names) with each weight of ``scales``
    (name -> its 0-dim fp32 per-tensor scale) quantized to NVFP4, and each other weight that
    base_model stores as NVFP4 copied from base_model; an adapted weight base_model does not store
    as NVFP4 is refused by name."""
    nvfp4_quantization_config(base_model)
    files = _files(Path(base_model))
    out = []
    for name, dt, shape, make in items:
        stored = all(name + s in files for s in _SCALES)
        inputs = name.removesuffix(".weight") + ".input_scale"
        extra = [_copy(files, inputs)] if inputs in files else []
        if name in scales:
            if not stored or len(shape) != 2:
                raise CheckpointMismatchError(f"nvfp4_merge_aware: {name} {list(shape)} is adapted but base_model "
                                              f"does not store it as an NVFP4 weight [out, in] ({name}_scale_2 "
                                              f"missing): target only the weights its quantization_config quantizes")
            out += _quantized(name, shape, make, scales[name]) + extra
        elif stored:
            out += [_copy(files, name)] + [_copy(files, name + s) for s in _SCALES] + extra
        else:
            out.append((name, dt, shape, make))
    return out


def _quantized(name: str, shape: tuple, make: Callable, pts: torch.Tensor) -> list:
    """The three ModelOpt tensors of the weight ``make()`` [out, in] quantized with ``pts``."""
    held: dict = {}

    def part(i: int):                     # (quantized once for both tensors, then let go)
        if "q" not in held:
            held.update(q=quantize_nvfp4(make().to(torch.float32), pts), left=2)
        t, held["left"] = held["q"][i], held["left"] - 1
        if not held["left"]:
            held.clear()
        return t
    out, k = shape
    return [(name, torch.uint8, (out, k // 2), lambda: part(0)),
            (name + "_scale", torch.float8_e4m3fn, (out, k // 16), lambda: part(1)),
            (name + "_scale_2", torch.float32, (), lambda pts=pts: pts.to(torch.float32).reshape(()).clone())]
