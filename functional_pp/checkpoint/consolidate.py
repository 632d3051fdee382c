"""Consolidation: turn a sharded checkpoint into one safetensors file, or a Hugging Face style
sharded set (``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``), holding
at most one full tensor in memory at a time."""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Callable

from functional_pp.checkpoint import format as fmt
from functional_pp.checkpoint.format import CheckpointError
from functional_pp.checkpoint.load import _Reader


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                key: str | None = "params", name_map: Callable[[str], str | None] | None = None,
                max_shard_bytes: int | None = None, step: int | None = None) -> Path:
    """Write the full tensors of ``checkpoint`` (a step directory or a root: its latest).

    ``key`` picks one top-level entry (names are then relative: ``"layers.0.w"``; ``None``
    exports every entry with full paths). ``name_map(path)`` renames tensors (``None`` drops
    one). Without ``max_shard_bytes``, ``out`` is a ``.safetensors`` file (or a directory that
    receives ``model.safetensors``); with it, ``out`` is a directory receiving a sharded set and
    ``model.safetensors.index.json``. Returns the file or directory written.
    """
    ckpt = fmt.resolve_checkpoint(checkpoint, step)
    index = fmt.read_index(ckpt)
    prefix = f"{key}." if key is not None else ""
    if key is not None and key not in index["structure"]["k"]:
        raise CheckpointError(f"{ckpt} has no entry {key!r}; entries: {index['structure']['k']}")
    items, names = [], {}
    reader = _Reader(ckpt, index["files"])
    for path, entry in index["tensors"].items():
        if not path.startswith(prefix) or entry.get("kind") == "per_rank":
            continue
        rel = path[len(prefix):]
        name = name_map(rel) if name_map else rel
        if name is None:
            continue
        if name in names:
            raise CheckpointError(f"name_map gives {name!r} to both {names[name]!r} and {rel!r}")
        names[name] = rel
        shape = tuple(entry["shape"])
        full = tuple(slice(0, n) for n in shape)
        items.append((name, fmt.dtype_from_name(entry["dtype"]), shape,
                      lambda path=path, entry=entry, full=full: reader.read(path, entry, full, 0)))
    meta = {"format": "pt", "source": str(ckpt), "step": str(index["step"])}
    out = Path(out)
    with reader:
        if max_shard_bytes is None:
            if out.is_dir() or out.suffix != ".safetensors":
                out.mkdir(parents=True, exist_ok=True)
                out = out / "model.safetensors"
            _write_atomic(out, items, meta)
            return out
        if max_shard_bytes <= 0:
            raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        write_sharded_set(out, items, meta, max_shard_bytes)
        return out


def write_sharded_set(out: Path, items: list, meta: dict, max_shard_bytes: int | None,
                      single_file: bool = False) -> None:
    """Write lazy tensor ``items`` (name, dtype, shape, read) into ``out`` as Hugging Face style
    shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json`` (or one
    ``model.safetensors`` when ``single_file`` and everything fits one shard)."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list] = [[]]
    size = 0
    for item in items:
        n = fmt.tensor_nbytes(item[2], item[1])
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    if single_file and len(shards) == 1:
        _write_atomic(out / "model.safetensors", shards[0], meta)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_atomic(out / fname, shard, meta)
        for name, dtype, shape, _ in shard:
            weight_map[name] = fname
            total += fmt.tensor_nbytes(shape, dtype)
    fmt.write_text_atomic(out / "model.safetensors.index.json", json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _write_atomic(path: Path, items: list, meta: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        fmt.write_safetensors(tmp, items, meta)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
