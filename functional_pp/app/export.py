"""``functional-pp export RUN_DIR|CHECKPOINT OUT_DIR``: a training run's checkpoint as a
Hugging Face directory (``config.json``, safetensors shards with their index, the tokenizer
files and BOS/EOS ids of the base model) that ``transformers`` loads. ``docs/finetune.md``.

An export never mixes with older files (docs/bad_inputs.md §11): it is written into a temporary
directory beside ``OUT_DIR`` and renamed into place; an ``OUT_DIR`` that holds only files an
export writes (an earlier export) is replaced whole, one holding anything else is refused."""
from __future__ import annotations

import fnmatch
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from functional_pp.checkpoint import format as fmt
from functional_pp.checkpoint.hf import export_checkpoint_to_hf
from functional_pp.checkpoint.hf_unheld import summary

__all__ = ["export_run", "resolve_run_checkpoint", "full_params", "TOKENIZER_FILES", "EXPORT_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "generation_config.json", "tekken.json")
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
#: what an export writes (patterns): an OUT_DIR holding only these is an earlier export
EXPORT_FILES = ("config.json", "model*.safetensors", "model.safetensors.index.json", "adapter_config.json",
                "adapter_model.safetensors", "README.md", ".consolidate-*", *TOKENIZER_FILES)


def resolve_run_checkpoint(src: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint directory of a run directory (its newest, or ``step``), a checkpoint
    root, or a step directory."""
    p = Path(src)
    if (p / "checkpoints").is_dir() and not (p / fmt.INDEX).is_file():
        p = p / "checkpoints"
    return fmt.resolve_checkpoint(p, step)


def export_run(src: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
               dtype: torch.dtype | None = None, max_shard_size: int | str | None = "2GB",
               merge_adapter: bool = False, described: bool = False) -> Path | tuple[Path, str]:
    """Write the HF directory ``out`` from run / checkpoint ``src``; returns ``out`` (and what
    was written, with ``described``). A LoRA run (docs/adapters.md) writes its PEFT adapter
    directory, or with ``merge_adapter`` the merged weights as a plain HF model."""
    ckpt = resolve_run_checkpoint(src, step)
    final = Path(out)
    _check_target(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    out = final.parent / f".{final.name}.export-{secrets.token_hex(4)}"
    out.mkdir()                                   # (the user's umask, as a plain mkdir)
    try:
        what = _write(ckpt, out, dtype, max_shard_size, merge_adapter)
        _put_in_place(out, final)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return (final, what) if described else final


def _write(ckpt: Path, out: Path, dtype, max_shard_size, merge_adapter: bool) -> str:
    """Write the export of ``ckpt`` into the empty directory ``out``; returns what it is."""
    meta = fmt.read_index(ckpt).get("metadata") or {}
    copied: list[str] = []               # base_model's tensors the model does not hold (checkpoint/hf_unheld.py)
    if meta.get("lora") is None:
        if merge_adapter:
            raise ValueError(f"{ckpt}: --merge-adapter: the run trained no adapter (it is a full model already)")
        export_checkpoint_to_hf(ckpt, out, max_shard_size=max_shard_size, dtype=dtype,
                                base_model=meta.get("base_model"), copied=copied)
        what = "Hugging Face directory"
    elif merge_adapter:
        _export_merged(ckpt, out, meta, max_shard_size, dtype, copied)
        what = "Hugging Face directory, adapters merged"
    elif meta.get("loftq"):
        raise ValueError(f"{ckpt}: a LoftQ run (peft.loftq_config) replaced base_model's adapted weights by their "
                         f"quantized form: its adapters over base_model are not the trained model; export it "
                         f"with --merge-adapter")
    else:
        _export_adapter(ckpt, out, meta)
        what = "PEFT adapter directory"
        return what
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
    if copied:
        what += f"; {len(copied)} tensors of base_model it does not hold copied unchanged: {summary(copied)}"
    return what


def _check_target(out: Path) -> None:
    """Refuse an ``out`` that holds files no export writes (they are not ours to replace)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory; choose a new directory to export into")
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir()
                     if not any(fnmatch.fnmatch(p.name, pat) for pat in EXPORT_FILES))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"{out} holds files that are not an export ({shown}); an export replaces its "
                         f"directory whole, so choose a new or empty directory")


def _put_in_place(tmp: Path, out: Path) -> None:
    """Rename the finished export ``tmp`` to ``out``; an earlier export there is replaced whole
    (moved aside, then removed): no file of it is left beside the new ones."""
    if out.is_dir():
        _check_target(out)                       # (again: nothing foreign arrived meanwhile)
        old = out.parent / f".{out.name}.replaced-{secrets.token_hex(4)}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def full_params(ckpt: Path) -> dict:
    """The whole parameter tree of a checkpoint (base and adapters), on this process; a quantized
    frozen base (QLoRA, saved as its codes and scales) dequantized to fp32."""
    import optree

    from functional_pp.checkpoint.load import load_checkpoint
    from functional_pp.quant.weights import QuantizedWeight, dequantize

    def quantized(x) -> bool:      # (loaded without a spec: a look-alike of QuantizedWeight)
        return isinstance(x, tuple) and getattr(type(x), "_fields", None) == QuantizedWeight._fields

    tree = load_checkpoint(ckpt, keys=["params"]).tree["params"]
    dims = _weight_dims(ckpt, tree, quantized)

    def one(path, x):
        if not quantized(x):
            return x
        q = QuantizedWeight(*x)
        if not q.flat:
            return dequantize(q)
        dim, lead = _flat_block_dim(path, dims)
        return dequantize(q, block_dim=dim, lead=lead)
    from functional_pp.core.tree import path_str
    return optree.tree_map_with_path(lambda p, x: one(path_str(p), x), tree, is_leaf=quantized, none_is_leaf=False)


def _weight_dims(ckpt: Path, tree, quantized) -> dict:
    """``{path: dimension names}`` of the model's parameters, from the checkpoint's model config,
    when the tree holds a flat quantized weight (its block dimension is not in its shapes); else
    empty."""
    import optree

    from functional_pp.checkpoint.hf import config_from_index
    from functional_pp.core.tree import leaves_with_paths
    from functional_pp.models import llama
    leaves = optree.tree_leaves(tree, is_leaf=quantized, none_is_leaf=False)
    if not any(quantized(x) and x[1].ndim < x[0].ndim for x in leaves):
        return {}
    return {p: tuple(d.dims) for p, d in leaves_with_paths(llama.init(config_from_index(fmt.read_index(ckpt))))}


def _flat_block_dim(path: str, dims: dict) -> tuple[int, int]:
    """``(block dimension, leading stack dimensions)`` of the flat quantized weight at ``path``
    (models.quantize.LINEAR_BLOCK_DIMS; an experts' stack, EXPERT_BLOCK_DIMS: its ``experts`` first)."""
    from functional_pp.models.quantize import EXPERT_BLOCK_DIMS, EXPERTS, LINEAR_BLOCK_DIMS, block_dim
    name = path.rsplit(".", 1)[-1]
    stack = path in dims and name in EXPERT_BLOCK_DIMS and dims[path][:1] == (EXPERTS,)
    table = EXPERT_BLOCK_DIMS if stack else LINEAR_BLOCK_DIMS
    if path not in dims or name not in table:
        raise ValueError(f"{path}: a flat quantized weight this export cannot place (no declaration of it in the "
                         f"checkpoint's model config)")
    return dims[path].index(block_dim(name, dims[path], table)), int(stack)


def _export_adapter(ckpt: Path, out: Path, meta: dict) -> None:
    from functional_pp.adapters import LoraConfig, split
    from functional_pp.adapters.peft_dir import save_adapter
    lora = LoraConfig(**meta["lora"])
    base, adapters = split(full_params(ckpt))
    save_adapter(out, adapters, lora, meta.get("base_model"), base=base)


def _export_merged(ckpt: Path, out: Path, meta: dict, max_shard_size, dtype, copied: list) -> None:
    from functional_pp.adapters import LoraConfig, merge
    from functional_pp.checkpoint.hf import config_from_index, save_hf_llama
    cfg = config_from_index(fmt.read_index(ckpt))
    lora, full = LoraConfig(**meta["lora"]), full_params(ckpt)
    # (nvfp4_merge_aware: the adapted weights in base_model's NVFP4 layout, with the scales training snapped with)
    scales = run_nvfp4_scales(full, lora, meta.get("base_model"))
    save_hf_llama(merge(full, lora, scales), cfg, out, max_shard_size=max_shard_size, dtype=dtype,
                  base_model=meta.get("base_model"), copied=copied, nvfp4=scales)


def run_nvfp4_scales(full: Any, lora: Any, base_model: str | None) -> dict | None:
    """The per-tensor scales a run's ``nvfp4_merge_aware`` training snapped with (``full``: its
    parameters with adapters): base_model's stored ``weight_scale_2``, as training read them, or
    without base_model each computed from its base weight; None without ``nvfp4_merge_aware``."""
    from functional_pp import adapters
    if not lora.nvfp4_merge_aware:
        return None
    if base_model is None:
        return adapters.nvfp4_scales(full, lora)
    from functional_pp.checkpoint.hf import nvfp4_stored_scales
    return nvfp4_stored_scales(base_model, list(adapters.split(full)[1]))
