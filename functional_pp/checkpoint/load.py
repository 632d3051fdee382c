"""Loading: each device reads only the slices it holds under the *current* mesh and rules
(any mesh: resharding happens by reading overlaps of the saved chunks)."""
from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors import safe_open

from functional_pp.checkpoint import format as fmt
from functional_pp.checkpoint.format import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from functional_pp.checkpoint.specs import LoadPlan, _children, _spec_paths, fill, is_param_like, path_str
from functional_pp.core.layout import Rules, block_slices
from functional_pp.core.mesh import Mesh
from functional_pp.core.runtime import current_context

_ST_TO_DTYPE = {fmt.st_dtype_code(dt): dt for dt in fmt._ST_DTYPES}


@dataclass
class Restored:
    """What :func:`load_checkpoint` returns."""

    step: int
    tree: dict[str, Any]          # this device's shards (full tensors without a mesh)
    metadata: Any                 # the JSON metadata given to save (e.g. loader position)
    config: Any                   # the JSON config given to save
    path: Path                    # the checkpoint directory that was read
    index: dict                   # the parsed index.json


class _Reader:
    """Open safetensors files lazily and read (parts of) chunks, checking them against the index."""

    def __init__(self, root: Path, files: dict[str, dict] | None, index: Path | None = None):
        self.root, self.files = root, files
        self.index = index or root / fmt.INDEX     # names the files (for messages)
        self.stack = ExitStack()
        self.handles: dict[str, Any] = {}
        self.keys: dict[str, set] = {}
        self.recorded: dict[str, dict] = {}    # file -> {tensor: [start, stop]} from its metadata
        self.verified: set[tuple[str, str]] = set()   # (file, tensor) whose checksum passed

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def handle(self, name: str):
        if name in self.handles:
            return self.handles[name]
        path = fmt.inside(self.root, name, str(self.index))
        if not path.is_file():
            raise CheckpointCorruptError(f"{path}: listed in the checkpoint index but missing")
        if self.files is not None:
            want = (self.files.get(name) or {}).get("bytes")
            have = path.stat().st_size
            if want is not None and have != want:
                raise CheckpointCorruptError(
                    f"{path} is truncated or corrupted: it has {have} bytes but index.json "
                    f"records {want}")
        try:
            h = self.stack.enter_context(safe_open(str(path), framework="pt"))
            self.keys[name] = set(h.keys())
            meta = h.metadata() or {}
        except Exception as exc:  # SafetensorError, OSError
            raise CheckpointCorruptError(f"cannot read {path}: not a valid safetensors file "
                                         f"(truncated or corrupted?): {exc}") from exc
        if fmt.CHUNKS_KEY in meta:
            try:
                self.recorded[name] = json.loads(meta[fmt.CHUNKS_KEY])
            except ValueError as exc:
                raise CheckpointCorruptError(f"{path}: its metadata {fmt.CHUNKS_KEY!r} is not valid "
                                             f"JSON (corrupted file)") from exc
        self.handles[name] = h
        return h

    def _open_slice(self, path: str, chunk: dict, dtype: torch.dtype):
        h = self.handle(chunk["file"])
        where = self.root / chunk["file"]
        if path not in self.keys[chunk["file"]]:
            raise CheckpointCorruptError(f"{where}: the index says it holds tensor {path!r}, but "
                                         f"the file has no such tensor")
        try:
            sl = h.get_slice(path)
            shape, code = list(sl.get_shape()), sl.get_dtype()
        except Exception as exc:
            raise CheckpointCorruptError(f"{where}: cannot read tensor {path!r}: {exc}") from exc
        recorded = self.recorded.get(chunk["file"], {}).get(path)
        if recorded is not None and recorded != [chunk["start"], chunk["stop"]]:
            raise CheckpointCorruptError(
                f"{where}: index.json says tensor {path!r} in this file is the region "
                f"start={chunk['start']} stop={chunk['stop']}, but the file records start={recorded[0]} "
                f"stop={recorded[1]}; index.json was edited or belongs to another checkpoint")
        want = [b - a for a, b in zip(chunk["start"], chunk["stop"])]
        if shape != want or _ST_TO_DTYPE.get(code) != dtype:
            raise CheckpointCorruptError(
                f"{where}: tensor {path!r} is {code} {shape} in the file but the index says "
                f"{fmt.dtype_name(dtype)} {want}")
        return h, sl, where

    def whole(self, path: str, chunk: dict, dtype: torch.dtype) -> torch.Tensor:
        h, _, where = self._open_slice(path, chunk, dtype)
        try:
            t = h.get_tensor(path)
        except Exception as exc:
            raise CheckpointCorruptError(f"{where}: cannot read tensor {path!r}: {exc}") from exc
        if "crc32" in chunk and fmt.crc32(t) != chunk["crc32"]:
            raise CheckpointCorruptError(f"{where}: tensor {path!r} fails its checksum (the file "
                                         f"is corrupted)")
        self.verified.add((chunk["file"], path))
        return t

    def part(self, path: str, chunk: dict, dtype: torch.dtype, local: tuple) -> torch.Tensor:
        """A region of a chunk. The first read of a chunk reads all of it to verify its
        checksum: every byte used is checked, on any layout (docs/bad_inputs.md §3)."""
        if "crc32" in chunk and (chunk["file"], path) not in self.verified:
            return self.whole(path, chunk, dtype)[local]
        _, sl, where = self._open_slice(path, chunk, dtype)
        try:
            return sl[local]
        except Exception as exc:
            raise CheckpointCorruptError(f"{where}: cannot read tensor {path!r}: {exc}") from exc

    def read(self, path: str, entry: dict, target: tuple[slice, ...], rank: int) -> torch.Tensor:
        """The region ``target`` (global coordinates) of tensor ``path``."""
        dtype = fmt.dtype_from_name(entry["dtype"])
        chunks = entry["chunks"]
        if entry.get("kind") == "per_rank":
            chunks = [c for c in chunks if c.get("rank") == rank]
        tshape = [s.stop - s.start for s in target]
        if fmt.numel(tshape) == 0:
            return torch.empty(tshape, dtype=dtype)
        t0, t1 = [s.start for s in target], [s.stop for s in target]
        for c in chunks:
            if c["start"] == t0 and c["stop"] == t1:
                return self.whole(path, c, dtype)
        out = torch.empty(tshape, dtype=dtype)
        covered = 0
        for c in chunks:
            lo = [max(a, b) for a, b in zip(t0, c["start"])]
            hi = [min(a, b) for a, b in zip(t1, c["stop"])]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            if lo == c["start"] and hi == c["stop"]:
                piece = self.whole(path, c, dtype)
            else:
                piece = self.part(path, c, dtype,
                                  tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, c["start"])))
            out[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, t0))] = piece
            covered += fmt.numel([b - a for a, b in zip(lo, hi)])
        if covered != fmt.numel(tshape):
            raise CheckpointCorruptError(
                f"{self.root / fmt.INDEX}: the chunks of tensor {path!r} cover {covered} of the "
                f"{fmt.numel(tshape)} elements of region {target} (a rank's file is missing from "
                f"the index?)")
        return out


@dataclass
class _Planned:
    name: str
    entry: dict
    spec: Any
    where: str


def _where(mesh: Mesh | None, rank: int | None) -> tuple[Mesh | None, int]:
    ctx = current_context(required=False)
    if mesh is None and ctx is not None:
        mesh = ctx.mesh
    if mesh is not None and rank is None:
        if ctx is None:
            raise CheckpointError("loading for a mesh outside functional_pp.launch needs rank=")
        rank = ctx.rank
    return mesh, rank or 0


def _target(spec: Any, shape: list[int], path: str, mesh: Mesh | None, rules: Rules | None,
            rank: int) -> tuple[slice, ...]:
    if is_param_like(spec) and mesh is not None and rules is not None:
        layout = rules.resolve(tuple(spec.dims), tuple(shape), mesh, name=path)
        return block_slices(tuple(shape), layout, mesh, rank)
    return tuple(slice(0, n) for n in shape)


#: mismatching tensors named in a load error (the rest counted): a changed model lists every one
PROBLEMS_SHOWN = 8


def _listing(title: str, paths: list[str], limit: int = 12) -> str:
    shown = ", ".join(paths[:limit]) + (f", ... ({len(paths) - limit} more)" if len(paths) > limit else "")
    return f"\n  {title} ({len(paths)}): {shown}"


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def load_checkpoint(path: str | os.PathLike, specs: dict[str, Any] | None = None, *,
                    mesh: Mesh | None = None, rules: Rules | None = None, rank: int | None = None,
                    step: int | None = None, keys: Iterable[str] | None = None,
                    config: dict | None = None, strict: bool = True,
                    device: torch.device | str | None = None) -> Restored:
    """Load a checkpoint (a ``step-N`` directory, or a root: its ``latest`` or ``step``).

    ``specs`` mirrors the saved tree like at save time; Param-like leaves are checked (shape,
    dtype) and come back as this device's shard under ``mesh``/``rules`` (inside launch the
    mesh and rank default to the running device's; without rules, or without a mesh, tensors
    come back whole). Entries and subtrees without specs come back whole, in their saved
    structure (namedtuples as look-alike namedtuples). ``keys`` restricts the top-level entries
    read. With ``config``, the saved config must equal it. Only the needed slices are read.
    """
    ckpt = fmt.resolve_checkpoint(path, step)
    index = fmt.read_index(ckpt)
    mesh, rank = _where(mesh, rank)
    if config is not None and index.get("config") != config:
        saved, want = _flat(index.get("config")), _flat(config)
        diff = [f"{k}: checkpoint {saved.get(k, '<absent>')!r}, expected {want.get(k, '<absent>')!r}"
                for k in sorted(set(saved) | set(want)) if saved.get(k, ...) != want.get(k, ...)]
        raise CheckpointMismatchError(f"{ckpt} was saved with a different config:\n  "
                                      + "\n  ".join(diff))
    specs = dict(specs or {})
    skel = index["structure"]
    top = dict(zip(skel["k"], skel["c"]))
    wanted = list(keys) if keys is not None else list(dict.fromkeys([*top, *specs]))
    plan = LoadPlan(index["tensors"])
    tree: dict[str, Any] = {}
    for key in wanted:
        if key not in top:
            plan.missing += _spec_paths(specs.get(key), (key,)) or [key]
            continue
        tree[key] = plan.build(top[key], specs.get(key), (key,))
    if plan.problems or (strict and (plan.missing or plan.unexpected)):
        msg = f"checkpoint {ckpt} does not match the model specs:"
        if plan.missing:
            msg += _listing("missing from the checkpoint", plan.missing)
        if plan.unexpected:
            msg += _listing("unexpected in the checkpoint", plan.unexpected)
        for p in plan.problems[:PROBLEMS_SHOWN]:
            msg += f"\n  {p}"
        if len(plan.problems) > PROBLEMS_SHOWN:
            msg += f"\n  ... and {len(plan.problems) - PROBLEMS_SHOWN} more tensors that do not match"
        raise CheckpointMismatchError(msg + "\n(a checkpoint of a different model or config?)")
    per_rank = [leaf.path for leaf in plan.leaves if leaf.entry.get("kind") == "per_rank"]
    world = mesh.size if mesh is not None else 1
    if per_rank and world != index.get("world_size"):
        raise CheckpointMismatchError(
            f"{ckpt}: {per_rank[:4]} were saved per rank from {index.get('world_size')} devices "
            f"and cannot be loaded on {world}; pass keys= without them, or give them fresh values")
    with _Reader(ckpt, index["files"]) as reader:
        for leaf in plan.leaves:
            target = _target(leaf.spec, leaf.entry["shape"], leaf.path, mesh, rules, rank)
            t = reader.read(leaf.path, leaf.entry, target, rank)
            leaf.result = t.to(device) if device is not None else t
    return Restored(step=index["step"], tree=fill(tree), metadata=index.get("metadata"),
                    config=index.get("config"), path=ckpt, index=index)


def load_safetensors(path: str | os.PathLike, specs: Any, *, mesh: Mesh | None = None,
                     rules: Rules | None = None, rank: int | None = None,
                     name_map: Callable[[str], str | None] | None = None, strict: bool = True,
                     device: torch.device | str | None = None) -> Any:
    """Load a plain safetensors file (or a directory with ``model.safetensors`` or a Hugging Face
    ``model.safetensors.index.json``) into a tree shaped like ``specs``: tensor ``name_map(path)``
    (default: the dotted path) for each Param-like leaf, sharded like :func:`load_checkpoint`."""
    p = Path(path)
    if p.suffix.lower() in fmt.PICKLE_SUFFIXES and not p.is_dir():
        raise fmt.pickle_refusal(p)
    if p.is_dir():
        hf_index = p / "model.safetensors.index.json"
        if hf_index.is_file():
            try:
                weight_map = json.loads(hf_index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise CheckpointCorruptError(f"{hf_index} is not a valid index: {exc}") from exc
            files = sorted(set(weight_map.values()))
        elif (p / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise fmt.CheckpointNotFoundError(f"no model.safetensors or model.safetensors.index.json "
                                              f"in {p}")
        root = p
        index_path = hf_index if hf_index.is_file() else None
    elif p.is_file():
        root, files, index_path = p.parent, [p.name], None
    else:
        raise fmt.CheckpointNotFoundError(f"no safetensors file at {p}")
    mesh, rank = _where(mesh, rank)
    with _Reader(root, None, index_path) as reader:
        entries: dict[str, dict] = {}
        for name in files:
            h = reader.handle(name)
            for key in reader.keys[name]:
                sl = h.get_slice(key)
                shape, code = list(sl.get_shape()), sl.get_dtype()
                if code not in _ST_TO_DTYPE:
                    raise CheckpointError(f"{root / name}: tensor {key!r} has unsupported dtype {code}")
                entries[key] = {"shape": shape, "dtype": fmt.dtype_name(_ST_TO_DTYPE[code]),
                                "chunks": [{"file": name, "start": [0] * len(shape), "stop": shape}]}
        used, missing, problems = set(), [], []

        def visit(spec: Any, path: tuple) -> Any:
            if is_param_like(spec):
                where = path_str(path)
                name = name_map(where) if name_map else where
                entry = entries.get(name)
                if entry is None:
                    missing.append(name if name == where else f"{name} (for {where})")
                    return None
                used.add(name)
                if tuple(entry["shape"]) != tuple(spec.shape):
                    problems.append(f"{name}: shape mismatch: file {tuple(entry['shape'])}, model "
                                    f"{tuple(spec.shape)}")
                    return None
                dtype = getattr(spec, "dtype", None)
                if dtype is not None and entry["dtype"] != fmt.dtype_name(dtype):
                    problems.append(f"{name}: dtype mismatch: file {entry['dtype']}, model "
                                    f"{fmt.dtype_name(dtype)}")
                    return None
                return _Planned(name, entry, spec, where)
            if isinstance(spec, (dict, list, tuple)):
                items = [(k, visit(v, path + (k,))) for k, v in _children(spec)]
                if isinstance(spec, dict):
                    return dict(items)
                vals = [v for _, v in items]
                return type(spec)(*vals) if hasattr(type(spec), "_fields") else type(spec)(vals)
            return None

        planned = visit(specs, ())
        unexpected = sorted(set(entries) - used)
        if problems or missing or (strict and unexpected):
            msg = f"{p} does not match the model specs:"
            if missing:
                msg += _listing("missing from the file", missing)
            if strict and unexpected:
                msg += _listing("unexpected in the file", unexpected)
            raise CheckpointMismatchError(msg + "".join(f"\n  {x}" for x in problems))

        def read(node: Any) -> Any:
            if isinstance(node, _Planned):
                name, entry, spec, where = node.name, node.entry, node.spec, node.where
                t = reader.read(name, entry, _target(spec, entry["shape"], where, mesh, rules, rank),
                                rank)
                return t.to(device) if device is not None else t
            if isinstance(node, dict):
                return {k: read(v) for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                vals = [read(v) for v in node]
                return type(node)(*vals) if hasattr(type(node), "_fields") else type(node)(vals)
            return node

        return read(planned)
