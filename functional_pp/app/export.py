"""``functional-pp export RUN_DIR|CHECKPOINT OUT_DIR``: a training run's checkpoint as a
Hugging Face directory (``config.json``, safetensors shards with their index, the tokenizer
files and BOS/EOS ids of the base model) that ``transformers`` loads. ``docs/finetune.md``."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from functional_pp.checkpoint import format as fmt
from functional_pp.checkpoint.hf import export_checkpoint_to_hf

__all__ = ["export_run", "resolve_run_checkpoint", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "generation_config.json")
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def resolve_run_checkpoint(src: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint directory of a run directory (its newest, or ``step``), a checkpoint
    root, or a step directory."""
    p = Path(src)
    if (p / "checkpoints").is_dir() and not (p / fmt.INDEX).is_file():
        p = p / "checkpoints"
    return fmt.resolve_checkpoint(p, step)


def export_run(src: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
               dtype: torch.dtype | None = None, max_shard_size: int | str | None = "2GB") -> Path:
    """Write the HF directory ``out`` from run / checkpoint ``src``; returns ``out``."""
    ckpt = resolve_run_checkpoint(src, step)
    out = Path(out)
    export_checkpoint_to_hf(ckpt, out, max_shard_size=max_shard_size, dtype=dtype)
    meta = fmt.read_index(ckpt).get("metadata") or {}
    base = meta.get("base_model")
    config = json.loads((out / "config.json").read_text())
    if base and (Path(base) / "config.json").is_file():
        src_cfg = json.loads((Path(base) / "config.json").read_text())
        config.update({k: src_cfg[k] for k in _SPECIAL_IDS if src_cfg.get(k) is not None})
    fmt.write_text_atomic(out / "config.json", json.dumps(config, indent=2))
    # the run's tokenizer first (it may hold added tokens), then base_model's other files
    for folder in dict.fromkeys(f for f in (meta.get("tokenizer_dir"), base) if f is not None):
        for name in TOKENIZER_FILES:
            f = Path(folder) / name
            if f.is_file() and not (out / name).exists():
                shutil.copy2(f, out / name)
    return out
