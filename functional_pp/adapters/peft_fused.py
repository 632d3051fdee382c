"""PEFT adapters of fused Hugging Face modules (Phi-3's ``qkv_proj`` and ``gate_up_proj``) from
our adapters of the split weights (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``).

A LoRA per part (``delta_j = s B_j A_j``, rank ``r`` each) is in general not one rank-``r``
adapter of the fused weight (the parts' A differ), but it is exactly one rank-``n r`` adapter:
``A`` the parts' A stacked (``[n r, in]``) and ``B`` block-diagonal (``[out, n r]``, part ``j``'s
rows and columns holding ``B_j``, zero elsewhere; a part without an adapter holds zero rows).
Its scale stays ``s`` through a per-module ``alpha`` (peft's ``rank_pattern`` /
``alpha_pattern``). A DoRA magnitude is per output row, and a fused row is one part's row, so the
fused magnitude is the parts' concatenated (an untargeted part's: its rows' norms, a factor 1)."""
from __future__ import annotations

import math
from typing import Any

import torch

from functional_pp.adapters.dora import MAGNITUDE, full_row_norm
from functional_pp.core.tree import leaves_with_paths
from functional_pp.models.llama_hf import file_name, hf_name

__all__ = ["fused_module", "fused_peft"]


def fused_module(path: str, model_type: str) -> str | None:
    """The fused Hugging Face module holding our weight ``path`` in ``model_type``'s files
    (``layers.0.self_attn.k_proj`` -> ``model.layers.0.self_attn.qkv_proj`` for ``phi3``), or None."""
    where = file_name(path, model_type)
    if where is None or where[0] == hf_name(path):
        return None
    return where[0][:-len(".weight")]


def fused_peft(lora: dict, base: Any, model_type: str, scale: float, rslora: bool) -> tuple[dict, dict, dict]:
    """``(state dict, ranks, alphas)`` of the fused modules' adapters: peft's tensors (without the
    ``base_model.model.`` prefix) and each fused module's rank and alpha, from the full adapters
    ``lora`` of the parts and the full base tree ``base`` (the untargeted parts' shapes and norms)."""
    groups: dict[str, dict[int, str]] = {}
    for path, _ in leaves_with_paths(base):
        m = fused_module(path, model_type)
        if m is not None:
            groups.setdefault(m, {})[file_name(path, model_type)[1]] = path
    weights = dict(leaves_with_paths(base))
    out, ranks, alphas = {}, {}, {}
    for module, parts in groups.items():
        paths = [parts[j] for j in sorted(parts)]
        adapted = [p for p in paths if p in lora]
        if not adapted:
            continue
        k = lora[adapted[0]]["lora_A"].ndim - 1            # (the parts share their input dimensions)
        r = lora[adapted[0]]["lora_A"].shape[-1]
        rows = [math.prod(weights[p].shape[k:]) for p in paths]
        n_in = math.prod(weights[paths[0]].shape[:k])
        a = torch.zeros(r * len(adapted), n_in, dtype=lora[adapted[0]]["lora_A"].dtype)
        b = torch.zeros(sum(rows), r * len(adapted), dtype=a.dtype)
        mags, row, col = [], 0, 0
        for p, n in zip(paths, rows):
            ab = lora.get(p)
            if ab is not None:
                a[col:col + r] = ab["lora_A"].reshape(n_in, r).T
                b[row:row + n, col:col + r] = ab["lora_B"].reshape(r, n).T
                col += r
            if MAGNITUDE in lora[adapted[0]]:
                w = weights[p].to(a.dtype)
                mags.append(ab[MAGNITUDE].reshape(-1) if ab is not None else
                            full_row_norm(w, torch.zeros(*w.shape[:k], 1, dtype=a.dtype),
                                          torch.zeros(1, *w.shape[k:], dtype=a.dtype), 0.0).reshape(-1))
            row += n
        out[module + ".lora_A.weight"], out[module + ".lora_B.weight"] = a, b
        if mags:
            out[module + ".lora_magnitude_vector"] = torch.cat(mags)
        ranks[module] = a.shape[0]
        alphas[module] = scale * (math.sqrt(a.shape[0]) if rslora else a.shape[0])
    return out, ranks, alphas
