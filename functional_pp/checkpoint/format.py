"""On-disk format of sharded checkpoints: errors, dtypes, a streaming safetensors writer,
the JSON index and the directory layout (``step-000010/``, the ``latest`` pointer).

A checkpoint root looks like::

    root/
      latest                      # "step-000010" (replaced atomically, written last)
      step-000010/
        index.json                # every tensor: path, axes, global shape, dtype, chunks
        rank-00000.safetensors    # the slices rank 0 wrote (one replica of each)
        rank-00001.safetensors
      step-000020.tmp-1a2b3c/     # a save in progress (or a crashed one): never loaded

Nothing here ever unpickles: tensors are safetensors, everything else is JSON.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import struct
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

FORMAT = "functional_pp.checkpoint"
VERSION = 1
DIGEST = "sha256"       # index.json's hash of the rest of itself (step, loader position, config, ...)
INDEX = "index.json"
LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d+)$")
TMP_RE = re.compile(r"^step-(\d+)\.(tmp|old)-[0-9a-f]+$")
FILE_TMP_RE = re.compile(r"^(latest|index\.json)\.tmp-[0-9a-f]+$")   # of write_text_atomic
CHUNKS_KEY = "functional_pp.chunks"   # safetensors metadata: {tensor path: [start, stop]}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


# --------------------------------------------------------------------------- errors
class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or loaded (the message says which file)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint at the given path."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated, unreadable or disagrees with ``index.json``."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not match the model specs or config it is loaded into."""


class UnsafeFormatError(CheckpointError, ValueError):
    """A pickle-based file was given; functional_pp never unpickles."""


def pickle_refusal(path: Path) -> UnsafeFormatError:
    return UnsafeFormatError(
        f"{path}: refusing to load a pickle-based file ({path.suffix!r}). Unpickling can execute "
        f"arbitrary code, so functional_pp never calls torch.load/pickle. Convert it once, in an "
        f"environment where you trust the file: `import torch, safetensors.torch; "
        f"safetensors.torch.save_file(torch.load({str(path)!r}, weights_only=True), "
        f"'model.safetensors')`, then read the .safetensors file with "
        f"functional_pp.checkpoint.load_safetensors (or save a checkpoint from it).")


# --------------------------------------------------------------------------- dtypes
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in _ST_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the name stored in ``index.json``)."""
    if dtype not in _ST_DTYPES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors; supported: "
                              f"{sorted(_BY_NAME)}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise CheckpointCorruptError(f"unknown dtype {name!r} in checkpoint index")
    return _BY_NAME[name]


def st_dtype_code(dtype: torch.dtype) -> str:
    dtype_name(dtype)
    return _ST_DTYPES[dtype]


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return numel(shape) * torch.empty((), dtype=dtype).element_size()


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def raw_bytes(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor, without a copy (a numpy uint8 view)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(raw_bytes(cpu_contiguous(t))) & 0xFFFFFFFF


# --------------------------------------------------------------------------- writing
TensorItem = tuple[str, torch.dtype, Sequence[int], Callable[[], torch.Tensor]]


def write_safetensors(path: Path, items: Sequence[TensorItem],
                      metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file from ``(name, dtype, shape, produce)`` items, calling each
    ``produce()`` only when its bytes are written (at most one tensor alive at a time).
    Returns the file size. OS errors (disk full, permissions) name the file."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape, _ in items:
        if name in header:
            raise CheckpointError(f"{path}: tensor name {name!r} appears twice")
        n = tensor_nbytes(shape, dtype)
        header[name] = {"dtype": st_dtype_code(dtype), "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, dtype, shape, produce in items:
                t = cpu_contiguous(produce())
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise CheckpointError(f"{path}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, "
                                          f"expected {dtype} {tuple(shape)}")
                f.write(raw_bytes(t))
                del t  # let it go before the next one is produced
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise CheckpointError(f"could not write checkpoint file {path}: "
                              f"{exc.strerror or exc} (errno {exc.errno})") from exc
    return 8 + len(blob) + offset


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync it, then ``os.replace`` it onto ``path``."""
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise CheckpointError(f"could not write {path}: {exc.strerror or exc} "
                              f"(errno {exc.errno})") from exc
    fsync_dir(path.parent)


def inside(root: Path, name: Any, what: str) -> Path:
    """``root / name``, refusing names that lead outside ``root`` (absolute paths, ``..``,
    symbolic links): a checkpoint's index may only point at files inside its directory."""
    if not isinstance(name, str) or not name:
        raise CheckpointCorruptError(f"{what} names file {name!r}, which is not a file name")
    path = root / name
    try:
        ok = Path(name).is_absolute() is False and path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):
        ok = False
    if not ok:
        raise CheckpointCorruptError(
            f"{what} names file {name!r}, which is outside the checkpoint directory {root}; only "
            f"files inside it are read (was the index edited by hand, or copied from elsewhere?). "
            f"Put the file inside {root} and name it relative to it")
    return path


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_json(obj: Any, what: str) -> Any:
    """Raise a clear error unless ``obj`` is JSON-serialisable; return it unchanged."""
    try:
        json.dumps(obj, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON-serialisable (dicts, lists, str, numbers, "
                              f"bools, None): {exc}") from exc
    return obj


# --------------------------------------------------------------------------- layout on disk
def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def step_dir_name(step: int) -> str:
    return f"step-{int(step):06d}"


def complete_steps(root: Path) -> dict[int, Path]:
    """``{step: dir}`` of the complete checkpoints under ``root`` (``step-N`` with an index)."""
    out: dict[int, Path] = {}
    if not root.is_dir():
        return out
    for child in root.iterdir():
        m = STEP_RE.match(child.name)
        if m and (child / INDEX).is_file():
            out[int(m.group(1))] = child
    return dict(sorted(out.items()))


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint named by ``root/latest`` when complete, else the highest complete step."""
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text().strip()
        except OSError:
            name = ""
        if STEP_RE.match(name) and (root / name / INDEX).is_file():
            return root / name
    steps = complete_steps(root)
    return steps[max(steps)] if steps else None


def resolve_checkpoint(path: str | os.PathLike, step: int | None = None) -> Path:
    """A checkpoint directory (holding ``index.json``) from itself or from a root directory
    (its ``latest`` checkpoint, or ``step``). Refuses pickle files."""
    p = Path(path)
    if p.suffix.lower() in PICKLE_SUFFIXES and not p.is_dir():
        raise pickle_refusal(p)
    if not p.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {p}: the path does not exist")
    if p.is_file():
        if p.suffix == ".safetensors":
            raise CheckpointError(f"{p} is a single safetensors file, not a checkpoint directory; "
                                  f"read it with functional_pp.checkpoint.load_safetensors")
        raise CheckpointNotFoundError(f"{p} is a file, not a checkpoint directory")
    if step is None and (p / INDEX).is_file():
        return p
    if step is not None:
        steps = complete_steps(p)
        if step not in steps:
            raise CheckpointNotFoundError(
                f"no complete checkpoint for step {step} in {p}; complete steps: {list(steps)}")
        return steps[step]
    found = latest_checkpoint(p)
    if found is None:
        pickles = sorted(c.name for c in p.iterdir() if c.suffix.lower() in PICKLE_SUFFIXES)
        extra = (f" It holds pickle-based files {pickles}, which functional_pp refuses to load "
                 f"(pickle can execute code); convert them to safetensors." if pickles else "")
        raise CheckpointNotFoundError(
            f"no checkpoint in {p}: expected {INDEX} or complete step-NNNNNN subdirectories "
            f"(in-progress *.tmp-* directories are ignored).{extra}")
    return found


def read_index(ckpt_dir: Path) -> dict:
    """Parse and sanity-check ``ckpt_dir/index.json``."""
    path = ckpt_dir / INDEX
    try:
        index = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointNotFoundError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise CheckpointCorruptError(f"{path} is not valid JSON (truncated or corrupted?): "
                                     f"{exc}") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path} is not a {FORMAT} index")
    if index.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has format version {index['version']}; this functional_pp "
                              f"reads versions <= {VERSION}")
    for key in ("step", "tensors", "files", "structure"):
        if key not in index:
            raise CheckpointCorruptError(f"{path} lacks the {key!r} field")
    if DIGEST in index and index[DIGEST] != index_digest(index):
        raise CheckpointCorruptError(
            f"{path} was changed after it was saved: its {DIGEST!r} does not match its contents (step "
            f"{index['step']!r}, loader position {(index.get('metadata') or {}).get('loader')!r}); an edited "
            f"step or data position would repeat or skip steps silently. Restore it, resume from another "
            f"checkpoint (resume_from_checkpoint: .../step-N), or delete its {DIGEST!r} field to load it as it is")
    return index


def index_digest(index: dict) -> str:
    """SHA-256 of ``index`` without its own :data:`DIGEST` entry, as JSON with sorted keys (the
    form written and read back: integer keys become strings)."""
    body = json.loads(json.dumps({k: v for k, v in index.items() if k != DIGEST}))
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def remove_tree(path: Path) -> None:
    """Best-effort recursive delete (used for temporary and pruned checkpoints)."""
    import shutil
    shutil.rmtree(path, ignore_errors=True)
