"""PEFT adapters of fused Hugging Face modules (Phi-3's ``qkv_proj`` and ``gate_up_proj``, GLM-4's
``gate_up_proj``, GPT-2's Conv1D ``c_attn``: peft reads it ``fan_in_fan_out``, its adapters in a Linear's layout) from
our adapters of the split weights (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``).

A LoRA per part (``delta_j = s B_j A_j``, rank ``r`` each) is in general not one rank-``r``
adapter of the fused weight (the parts' A differ), but it is exactly one rank-``n r`` adapter:
``A`` the parts' A stacked (``[n r, in]``) and ``B`` block-diagonal (``[out, n r]``, part ``j``'s
rows and columns holding ``B_j``, zero elsewhere; a part without an adapter holds zero rows).
Its scale stays ``s`` through a per-module ``alpha`` (peft's ``rank_pattern`` /
``alpha_pattern``). A DoRA magnitude is per output row, and a fused row is one part's row, so the
fused magnitude is the parts' concatenated (an untargeted part's: its rows' norms, a factor 1).

Read back (:func:`split_fused_peft`), a fused adapter of rank ``R`` is split exactly into our
rank-``r`` adapters of the parts: with ``R = r`` (what peft trains on ``qkv_proj``: one A shared
by the parts) each part gets a copy of ``A`` and its row block of ``B``; with ``R = n r`` and a
block-diagonal ``B`` (what :func:`fused_peft` writes) each part its own ``r`` columns. Anything
else (an untargeted part's rows nonzero, ``B`` not block-diagonal, another rank, another scale)
is not exactly our adapters and is refused by name."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from functional_pp.adapters.dora import MAGNITUDE, full_row_norm
from functional_pp.core.tree import leaves_with_paths
from functional_pp.models.llama_hf import (FUSED, HEAD_GROUPED, HEAD_INTERLEAVED, LLAMA_TABLE, MULTIMODAL, file_name,
                                          renamed)
from functional_pp.models.remote_code_hf import with_file_layout

__all__ = ["fused_module", "fused_peft", "model_type_of", "part_names", "split_fused_peft"]


def fused_module(path: str, model_type: str) -> str | None:
    """The fused Hugging Face module holding our weight ``path`` in ``model_type``'s files
    (``layers.0.self_attn.k_proj`` -> ``model.layers.0.self_attn.qkv_proj`` for ``phi3``), or None."""
    where = file_name(path, model_type)
    if where is None or where[0] == renamed(path, model_type):
        return None
    return where[0].rsplit(".", 1)[0]


def model_type_of(base_model: str | None) -> str:
    """``model_type`` of a Hugging Face model directory's ``config.json`` (``llama`` without one), or the
    internal family whose names its files hold (Replit's MPT: ``replit_mpt``)."""
    f = Path(base_model) / "config.json" if base_model else None
    if f is None or not f.is_file():
        return "llama"
    hf = json.loads(f.read_text())
    return with_file_layout(hf, base_model).get("model_type", "llama") if isinstance(hf, dict) else "llama"


def decoder_type_of(base_model: str | None) -> str:
    """The text decoder's ``model_type`` of a Hugging Face model directory (:func:`model_type_of`; a
    multimodal wrapper's ``text_config`` one, or its default family: models/llama_hf.py's ``MULTIMODAL``)."""
    mt = model_type_of(base_model)
    if mt not in MULTIMODAL:
        return mt
    hf = json.loads((Path(base_model) / "config.json").read_text())
    return (hf.get("text_config") or {}).get("model_type") or MULTIMODAL[mt] or mt


def part_names(modules: Any, model_type: str) -> tuple[str, ...]:
    """Module names of ``model_type``'s model in ours: fused ones replaced by their parts'
    (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``; ``gate_up_proj`` -> ``gate_proj``,
    ``up_proj``), renamed ones by ours (Phi's ``dense`` -> ``o_proj``, ``fc1`` -> ``up_proj``; GPT-2's
    ``c_proj``, a module of attention and of the MLP, -> ``o_proj`` and ``down_proj``); a dotted name
    keeps its prefix (``linear_attn.in_proj_qkv`` -> ``linear_attn.in_proj_q``, ...)."""
    fused = {f.rsplit(".", 2)[-2]: [p.rsplit(".", 2)[-2] for p in parts] for f, parts in FUSED.get(model_type, ())}
    ours: dict[str, list[str]] = {}
    for llama_name, path, _ in LLAMA_TABLE:          # each module the family's files rename -> ours
        name, leaf = renamed(path.format(i=0), model_type), llama_name.rsplit(".", 2)[-2]
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] != leaf:
            names = ours.setdefault(name.rsplit(".", 2)[-2], [])
            if path.rsplit(".", 1)[-1] not in names:
                names.append(path.rsplit(".", 1)[-1])

    def parts(m: str) -> list[str]:
        head, dot, leaf = m.rpartition(".")
        return [head + dot + o for p in fused.get(leaf, [leaf]) for o in ours.get(p, [p])]
    return tuple(dict.fromkeys(o for m in modules for o in parts(m)))


def fused_peft(lora: dict, base: Any, model_type: str, scale: float, rslora: bool) -> tuple[dict, dict, dict]:
    """``(state dict, ranks, alphas)`` of the fused modules' adapters: peft's tensors (without the
    ``base_model.model.`` prefix) and each fused module's rank and alpha, from the full adapters
    ``lora`` of the parts and the full base tree ``base`` (the untargeted parts' shapes and norms)."""
    groups: dict[str, dict[int, str]] = {}
    for path, _ in leaves_with_paths(base):
        m = fused_module(path, model_type)
        if m is not None and not _bias_part(path, model_type):
            groups.setdefault(m, {})[file_name(path, model_type)[1]] = path
    weights = dict(leaves_with_paths(base))
    out, ranks, alphas = {}, {}, {}
    for module, parts in groups.items():
        paths = [parts[j] for j in sorted(parts)]
        adapted = [p for p in paths if p in lora]
        if not adapted:
            continue
        if model_type in HEAD_INTERLEAVED or any(re.search(p, module) for p, _ in HEAD_GROUPED.get(model_type, ())):
            raise ValueError(f"PEFT adapter: {module} of {model_type} holds q, k and v head by head; adapters of it "
                             f"are not supported yet: export the merged model (functional-pp export --merge-adapter)")
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


def _bias_part(path: str, model_type: str) -> bool:
    """Whether ``path`` is a part of a fused bias (GPT-2's ``c_attn.bias``: q, k and v biases), not
    of the fused weight that the module's adapter acts on."""
    return file_name(path, model_type)[0].endswith("bias")


def _rows(d: Any) -> int:
    """Rows of a weight declaration in the HF layout (its output dimensions, past the ``in_dims``)."""
    return math.prod(d.shape[int(d.meta.get("in_dims", 1)):])


def split_fused_peft(tensors: dict[str, torch.Tensor], base_decls: Any, want: dict, model_type: str,
                     module_scale: Any, scale: float) -> tuple[dict, set]:
    """``(our full adapters of the fused modules' parts, the peft tensor names used)``: the
    adapters ``want`` (``{weight path: {"lora_A", "lora_B"[, magnitude]}}`` declarations) whose
    weight is part of a fused module of ``model_type``, from peft's state dict ``tensors``
    (without the ``base_model.model.`` prefix); ``base_decls`` give the untargeted parts' rows,
    ``module_scale(module)`` the scale peft applies to a fused module (its rank and alpha from
    ``rank_pattern`` / ``alpha_pattern``), which must be ours (``scale``)."""
    groups: dict[str, list[tuple[int, str, Any]]] = {}
    for path, d in leaves_with_paths(base_decls):
        m = fused_module(path, model_type)
        if m is not None and not _bias_part(path, model_type):
            groups.setdefault(m, []).append((file_name(path, model_type)[1], path, d))
    out, used = {}, set()
    for module, parts in groups.items():
        parts.sort()
        adapted = [p for _, p, _ in parts if p in want]
        if not adapted:
            continue
        names = [module + ".lora_A.weight", module + ".lora_B.weight"]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"PEFT adapter: {missing[0]} is missing (for {', '.join(adapted)}, fused in {model_type}'s "
                             f"{module}); the adapter was made for other target modules or another model")
        a, b = tensors[names[0]], tensors[names[1]]
        r, R = want[adapted[0]]["lora_A"].shape[-1], a.shape[0]
        rows = [_rows(d) for _, _, d in parts]
        if b.shape != (sum(rows), R) or a.ndim != 2:
            raise ValueError(f"PEFT adapter: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected "
                             f"[{R}, in] / [{sum(rows)}, {R}] (the rows of {', '.join(p for _, p, _ in parts)})")
        s = module_scale(module)
        if not math.isclose(s, scale, rel_tol=1e-12):
            raise ValueError(f"PEFT adapter: {module} is scaled {s:g} (its rank and alpha in the adapter's "
                             f"adapter_config.json), the run's adapters {scale:g}: set lora_alpha / lora_r / "
                             f"peft_use_rslora as the adapter was trained")
        shared = R == r
        if not shared and R != r * len(adapted):
            raise ValueError(f"PEFT adapter: {module} has rank {R}; the run's adapters of its parts ({', '.join(adapted)}) "
                             f"rank {r}: it splits exactly into rank-{r} adapters only when {R} = r (one A shared "
                             f"by the parts: set lora_r: {R}) or {R} = {len(adapted)} x r (one block per part)")
        mag = tensors.get(module + ".lora_magnitude_vector")
        row, col = 0, 0
        for (_, path, _), n in zip(parts, rows):
            block = b[row:row + n]
            if path not in want:
                if block.count_nonzero():
                    raise ValueError(f"PEFT adapter: {module}'s lora_B rows of {path} are nonzero, but {path} is not a "
                                     f"target of the run: add it to lora_target_modules")
            else:
                ab = want[path]
                cols = slice(None) if shared else slice(col, col + r)
                if not shared and (block[:, :col].count_nonzero() or block[:, col + r:].count_nonzero()):
                    raise ValueError(f"PEFT adapter: {module}'s lora_B is not block-diagonal ({path}'s rows reach "
                                     f"other parts' columns): it is no set of rank-{r} adapters of the parts; "
                                     f"set lora_r: {R} to read it as one shared A")
                A, B = ab["lora_A"], ab["lora_B"]
                out[path] = {"lora_A": a[cols].T.reshape(A.shape).to(A.dtype).clone(),
                             "lora_B": block[:, cols].T.reshape(B.shape).to(B.dtype).clone()}
                if MAGNITUDE in ab:
                    if mag is None or mag.shape != (sum(rows),):
                        raise ValueError(f"PEFT adapter: {module}.lora_magnitude_vector [{sum(rows)}] is missing or "
                                         f"misshapen: the config has use_dora: true")
                    out[path][MAGNITUDE] = mag[row:row + n].reshape(ab[MAGNITUDE].shape).to(ab[MAGNITUDE].dtype).clone()
                col += 0 if shared else r
            row += n
        used.update(names)
        if mag is not None:
            used.add(module + ".lora_magnitude_vector")
    return out, used
