"""Tensors of ``base_model``'s files that the model does not hold, copied unchanged into an export
of the same class, so that the export is the whole checkpoint (LLaVA-1.5's CLIP tower declares only
the layers up to ``vision_feature_layer``: its later layers and ``post_layernorm`` would otherwise be
missing, and transformers would initialise them randomly on load).

Copied only where nothing else can be meant: the export writes base_model's own class
(``architectures``) and base_model is not quantized (its files would hold quantization states, not
weights). A base tensor is held when the export writes it under its name or under a name import
also reads it by (``llama_hf.ALSO_READ``: transformers 5's ``vision_tower.`` for the files'
``vision_tower.vision_model.``); a tensor not held is written under the export's own convention
(such a prefix turned back) with its bits and dtype as stored. Old checkpoints' rotary buffers and
the stored copy of a tied head are not parameters and are left out."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from functional_pp.checkpoint import format as fmt
from functional_pp.models.llama_hf import ALSO_READ, IGNORED_HF, also_read, config_to_hf

__all__ = ["unheld_items", "summary"]

Item = tuple
"""``(name, dtype, shape, make)``: a lazy tensor as ``consolidate.write_sharded_set`` writes it."""


def unheld_items(base_model: str | Path | None, cfg: Any, written: list[str]) -> list[Item]:
    """Lazy items of every tensor of ``base_model``'s safetensors that an export of ``cfg`` writing
    ``written`` does not hold (none where base_model is absent, another class or quantized)."""
    if base_model is None or not (Path(base_model) / "config.json").is_file():
        return []
    base = Path(base_model)
    try:
        raw = json.loads((base / "config.json").read_text())
    except (OSError, ValueError):
        return []
    if raw.get("quantization_config") or raw.get("architectures") != config_to_hf(cfg).get("architectures"):
        return []
    files = _tensor_files(base)
    held = set(written) | {a for w in written for a in also_read(w, getattr(cfg, "model_type", "llama"), cfg)}
    back = _prefixes_back(cfg, written, files)
    buffers = [re.compile(f"^{x}$") for x in IGNORED_HF + ((r"lm_head\.weight",) if cfg.tie_embeddings else ())]
    items = []
    for name, f in files.items():
        if name in held or any(b.match(name) for b in buffers):      # (rotary buffers; a tied head's copy)
            continue
        with safe_open(str(f), framework="pt") as h:
            sl = h.get_slice(name)
            shape, dtype = tuple(sl.get_shape()), _dtype(sl.get_dtype())
        items.append((_turned_back(name, back), dtype, shape, _reader(f, name)))
    return items


def summary(names: list[str]) -> str:
    """``names`` by layer or module: ``vision_tower.vision_model.encoder.layers.1 (16), ...post_layernorm (2)``."""
    modules = Counter(m.group(1) if (m := re.match(r"^(.*\.layers\.\d+)\.", n)) else n.rsplit(".", 1)[0]
                      for n in names)
    return ", ".join(f"{m} ({k})" for m, k in modules.items())


def _tensor_files(base: Path) -> dict[str, Path]:
    """Every tensor name of base's safetensors -> its file."""
    index = base / "model.safetensors.index.json"
    if index.is_file():
        return {k: base / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = base / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), framework="pt") as h:
        return {k: single for k in h.keys()}


def _prefixes_back(cfg: Any, written: list[str], files: dict[str, Path]) -> list[tuple[str, str]]:
    """``(prefix in base's files, prefix the export writes)`` of each ALSO_READ row that is a plain
    prefix and that base's files use in place of the export's (a written name found only under it)."""
    rows = ALSO_READ.get(getattr(cfg, "model_type", "llama"), ()) + ALSO_READ.get(getattr(cfg, "text_of", None)
                                                                                 or "", ())
    back = []
    for pattern, repl in rows:
        ours = re.sub(r"\\(.)", r"\1", pattern[1:]) if pattern.startswith("^") else None
        if ours is None or re.escape(ours) != pattern[1:]:
            continue
        if any(w.startswith(ours) and w not in files and repl + w[len(ours):] in files for w in written):
            back.append((repl, ours))
    return back


def _turned_back(name: str, back: list[tuple[str, str]]) -> str:
    for theirs, ours in back:
        if name.startswith(theirs) and not name.startswith(ours):
            return ours + name[len(theirs):]
    return name


def _dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (``F32``, ``BF16``, ...)."""
    dtypes = {c: dt for dt, c in fmt._ST_DTYPES.items()}
    if code not in dtypes:
        raise fmt.CheckpointError(f"unsupported safetensors dtype {code}")
    return dtypes[code]


def _reader(f: Path, name: str) -> Callable:
    def make():
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(name)
    return make
