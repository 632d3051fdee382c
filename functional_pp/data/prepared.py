"""Tokenized datasets cached in ``dataset_prepared_path`` (Axolotl's key): the token streams of
``build_streams`` saved as ``.npy`` files under a key that hashes everything they depend on (the
build settings, the contents of every dataset and tokenizer file, the code that tokenizes), and
reused while these are unchanged; any change gives a new key, so the data is tokenized again.
An entry is written to a temporary directory and renamed into place (processes racing to write
the same entry keep the first)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from functional_pp.data.formats import DatasetStats, TokenStream

__all__ = ["fingerprint", "code_version", "load_or_build"]

_VERSION = 4          # 3: keyed on the files' contents and the tokenizing code; 4: document starts kept


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path] if path.exists() else []


def _hash_file(h: "hashlib._Hash", f: Path) -> None:
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of the code that turns data files into tokens: the sources of ``functional_pp.data``
    (formats, chat templates, packing) and the package version; an edited reader tokenizes again
    even where the version number did not change."""
    from functional_pp.version import __version__
    h = hashlib.sha256(__version__.encode())
    root = Path(__file__).parent
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".py", ".jinja")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        _hash_file(h, f)
    return h.hexdigest()[:16]


def fingerprint(settings: dict, paths: list[str | Path]) -> str:
    """A hex key of ``settings`` (JSON-able), the code version and the path and contents (SHA-256)
    of every file under ``paths``: a file rewritten with the same size and time gives a new key."""
    h = hashlib.sha256(json.dumps([_VERSION, code_version(), settings], sort_keys=True, default=str).encode())
    for root in paths:
        for f in _files(Path(root)):
            h.update(f"{f.resolve()}:{f.stat().st_size}\n".encode())
            _hash_file(h, f)
    return h.hexdigest()[:16]


def _save(d: Path, tag: str, s: TokenStream) -> dict:
    np.save(d / f"{tag}_tokens.npy", np.asarray(s.tokens))
    if s.trained is not None:
        np.save(d / f"{tag}_trained.npy", np.asarray(s.trained))
    if s.starts is not None:
        np.save(d / f"{tag}_starts.npy", np.asarray(s.starts))
    stats = [{**dataclasses.asdict(st), "sample": None} for st in s.stats]
    return {"eos_id": s.eos_id, "vocab_size": s.vocab_size, "name": s.name, "documents": s.documents,
            "trained": s.trained is not None, "starts": s.starts is not None, "stats": stats}


def _load(d: Path, tag: str, meta: dict) -> TokenStream:
    tokens = _array(d / f"{tag}_tokens.npy")
    trained = _array(d / f"{tag}_trained.npy") if meta["trained"] else None
    starts = _array(d / f"{tag}_starts.npy") if meta.get("starts") else None
    for name, flags in (("trained", trained), ("starts", starts)):
        if flags is not None and flags.shape != tokens.shape:
            raise ValueError(f"{d / f'{tag}_{name}.npy'} holds {flags.shape[0]} flags for {tokens.shape[0]} tokens")
    return TokenStream(tokens, trained, meta["eos_id"], meta["vocab_size"], meta["name"], meta["documents"],
                       [DatasetStats(**st) for st in meta["stats"]], starts=starts)


def _array(path: Path) -> np.ndarray:
    """A saved 1-D array, memory-mapped; a cut or damaged file raises naming it."""
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    if arr.ndim != 1:
        raise ValueError(f"{path} holds a {arr.ndim}-D array, not the 1-D tokens it was saved with")
    return arr


def _reuse(d: Path) -> tuple[TokenStream, TokenStream | None]:
    """The streams saved in entry ``d``; a damaged entry (a cut file, edited ``meta.json``) is
    refused naming the file and the entry to delete."""
    try:
        meta = json.loads((d / "meta.json").read_text())
        val = _load(d, "val", meta["val"]) if meta["val"] else None
        return _load(d, "train", meta["train"]), val
    except (ValueError, KeyError, TypeError) as exc:
        where = str(exc) if str(d) in str(exc) else f"{d / 'meta.json'}: {type(exc).__name__}: {exc}"
        raise ValueError(f"dataset_prepared_path: the tokenized datasets in {d} are damaged ({where}); "
                         f"delete {d} to tokenize the datasets again") from exc


def load_or_build(root: str | Path, settings: dict, paths: list[str | Path],
                  build: Callable[[], tuple[TokenStream, TokenStream | None]]) -> tuple[Any, Any, str]:
    """``(train, val, what happened)``: the cached streams of this key under ``root``, or
    ``build()``'s, saved there."""
    key = fingerprint(settings, paths)
    d = Path(root) / key
    meta_path = d / "meta.json"
    if meta_path.is_file():
        return (*_reuse(d), f"reused the tokenized datasets in {d}")
    train, val = build()
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        meta = {"train": _save(tmp, "train", train), "val": _save(tmp, "val", val) if val is not None else None}
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, d)
        except OSError:                 # written meanwhile by another process: keep that one
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return train, val, f"tokenized the datasets and saved them in {d} (dataset_prepared_path)"
