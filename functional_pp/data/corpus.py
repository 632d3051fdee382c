"""Token sources that need no download.

The default corpus is the Python standard library's own source code, read as
bytes (vocabulary 256).  It is present on every machine that runs Python, so
tests and examples can train a small language model without network access.
The same text gathering also works over a single ``.txt`` file, a directory of
``.txt`` files or a ``.jsonl`` file, and — optionally — through a Hugging Face
``tokenizer.json`` (requires the ``tokenizers`` package, imported lazily).

Tokens are kept as a compact 1-D numpy array (``np.uint8`` for bytes); the
loader converts to ``torch.int64`` one batch at a time.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from functional_pp.core.optional import require
from functional_pp.data.utf8 import decode as decode_utf8

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Corpus",
    "ByteCorpus",
    "TokenizerCorpus",
    "load_corpus",
    "stdlib_dir",
]

#: Default cap on the raw text read (8 MiB): large enough to be non-trivial,
#: small enough to load in well under a second.
DEFAULT_MAX_BYTES: int = 8 * 1024 * 1024

# Directory names skipped when walking the standard library: installed
# third-party packages, test suites (and their data files), caches, and the
# platform-specific build config directory.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
# Files whose content depends on the build platform rather than the version.
_STDLIB_SKIP_FILE_PREFIXES = ("_sysconfigdata",)

_KINDS = ("auto", "stdlib", "text", "dir", "jsonl")


def stdlib_dir() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


# ----------------------------------------------------------------------------
# Corpus container
# ----------------------------------------------------------------------------


class Corpus:
    """A 1-D token stream with its vocabulary size and a human-readable name."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, name: str) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"corpus tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.size == 0:
            raise ValueError(f"corpus {name!r} is empty (0 tokens)")
        self.tokens: np.ndarray = tokens
        self.vocab_size: int = int(vocab_size)
        self.name: str = name

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, tokens={len(self)}, "
            f"vocab_size={self.vocab_size}, dtype={self.tokens.dtype})"
        )

    def split(self, val_fraction: float) -> tuple["Corpus", "Corpus"]:
        """Split into ``(train, validation)``: the last ``val_fraction`` of the
        stream (rounded down, at least one token) becomes validation."""
        if not 0.0 < float(val_fraction) < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        n = len(self)
        n_val = max(1, int(n * float(val_fraction)))
        n_train = n - n_val
        if n_train < 1:
            raise ValueError(
                f"corpus {self.name!r} has {n} tokens, too few to split with "
                f"val_fraction={val_fraction}"
            )
        train = Corpus(self.tokens[:n_train], self.vocab_size, f"{self.name}[train]")
        val = Corpus(self.tokens[n_train:], self.vocab_size, f"{self.name}[val]")
        return train, val


# ----------------------------------------------------------------------------
# Text gathering
# ----------------------------------------------------------------------------


def _walk_files(root: Path, pattern: str, skip_dirs: frozenset[str] = frozenset(),
                skip_prefixes: tuple[str, ...] = ()) -> list[Path]:
    """Files under ``root`` matching ``pattern``, sorted by relative POSIX path."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [
            d for d in dirnames
            if d not in skip_dirs and d != "__pycache__" and not d.startswith(".")
        ]
        for fname in filenames:
            if fname.startswith(".") or fname.startswith(skip_prefixes):
                continue
            p = Path(dirpath) / fname
            if not p.match(pattern) or not p.is_file():
                continue
            found.append((p.relative_to(root).as_posix(), p))
    found.sort(key=lambda item: item[0])
    return [p for _, p in found]


def _iter_jsonl(path: Path, text_field: str) -> Iterator[tuple[str, bytes]]:
    """``(where, UTF-8 text)`` of each record's ``text_field``."""
    with open(path, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            line = decode_utf8(raw, path, line=lineno, offset=offset).strip()
            offset += len(raw)
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{path}:{lineno}: record has no field {text_field!r}")
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, not str"
                )
            yield f"{path}: line {lineno}", text.encode("utf-8")


def _resolve_kind(path: Path | None, kind: str) -> str:
    if kind not in _KINDS:
        raise ValueError(f"unknown corpus kind {kind!r}; expected one of {_KINDS}")
    if path is None:
        if kind not in ("auto", "stdlib"):
            raise ValueError(f"corpus kind {kind!r} needs a path")
        return "stdlib"
    if kind == "stdlib":
        return "stdlib"
    if not path.exists():
        raise FileNotFoundError(f"corpus path does not exist: {path}")
    if kind != "auto":
        return kind
    if path.is_dir():
        return "dir"
    if path.suffix.lower() == ".jsonl":
        return "jsonl"
    return "text"


def _iter_documents(path: Path | None, kind: str, *, pattern: str | None,
                    text_field: str) -> tuple[Iterator[bytes], str]:
    """Resolve ``(path, kind)`` to an iterator of raw documents and a name."""
    docs, name = _named_documents(path, kind, pattern=pattern, text_field=text_field)
    return (raw for _, raw in docs), name


def _named_documents(path: Path | None, kind: str, *, pattern: str | None,
                     text_field: str) -> tuple[Iterator[tuple[str, bytes]], str]:
    """Resolve ``(path, kind)`` to an iterator of ``(where it came from, raw document)`` and a name."""
    kind = _resolve_kind(path, kind)
    if kind == "stdlib":
        root = stdlib_dir() if path is None else path
        if not root.is_dir():
            raise FileNotFoundError(f"corpus path does not exist: {root}")
        files = _walk_files(root, pattern or "*.py", _STDLIB_SKIP_DIRS,
                            _STDLIB_SKIP_FILE_PREFIXES)
        return ((str(p), p.read_bytes()) for p in files), f"stdlib:{root.name}"
    assert path is not None
    if kind == "dir":
        if not path.is_dir():
            raise NotADirectoryError(f"corpus path is not a directory: {path}")
        files = _walk_files(path, pattern or "*.txt")
        if not files:
            raise ValueError(f"corpus directory {path} has no files matching "
                             f"{pattern or '*.txt'!r}")
        return ((str(p), p.read_bytes()) for p in files), f"dir:{path.name}"
    if kind == "jsonl":
        return _iter_jsonl(path, text_field), f"jsonl:{path.name}"
    # kind == "text": one file, one document
    if not path.is_file():
        raise ValueError(f"corpus path is not a file: {path}")
    return iter([(str(path), path.read_bytes())]), f"text:{path.name}"


def _gather_bytes(docs: Iterator[bytes], separator: int | None,
                  max_bytes: int | None) -> bytes:
    """Concatenate documents (with ``separator`` between them), capped at
    ``max_bytes``; stops reading as soon as the cap is reached."""
    if separator is not None and not 0 <= separator < 256:
        raise ValueError(f"separator must be a byte value in [0, 256), got {separator}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    sep = b"" if separator is None else bytes([separator])
    parts: list[bytes] = []
    total = 0
    for doc in docs:
        if not doc:
            continue
        if parts and sep:
            parts.append(sep)
            total += len(sep)
        parts.append(doc)
        total += len(doc)
        if max_bytes is not None and total >= max_bytes:
            break
    data = b"".join(parts)
    if max_bytes is not None:
        data = data[:max_bytes]
    return data


# ----------------------------------------------------------------------------
# Concrete corpora
# ----------------------------------------------------------------------------


class ByteCorpus(Corpus):
    """Byte-level tokens (vocab 256) over text files.

    With ``path=None`` reads the standard library's ``*.py`` files (recursive,
    sorted by relative path, skipping ``site-packages``, test suites and
    platform-specific files), joined by ``separator`` and capped at
    ``max_bytes`` — deterministic for a given Python version.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, kind: str = "auto",
                 pattern: str | None = None, text_field: str = "text",
                 max_bytes: int | None = DEFAULT_MAX_BYTES, separator: int | None = 0) -> None:
        p = None if path is None else Path(path)
        docs, name = _iter_documents(p, kind, pattern=pattern, text_field=text_field)
        data = _gather_bytes(docs, separator, max_bytes)
        if not data:
            raise ValueError(f"corpus {p if p is not None else name} is empty (0 bytes of text)")
        super().__init__(np.frombuffer(data, dtype=np.uint8).copy(), 256, name)

    @staticmethod
    def encode(text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as a uint8 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    @staticmethod
    def decode(tokens: Any) -> str:
        """Inverse of :meth:`encode` (invalid UTF-8 is replaced)."""
        arr = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
        return bytes(arr.astype(np.uint8).tolist()).decode("utf-8", errors="replace")


def _load_tokenizer(tokenizer: Any) -> Any:
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer  # assume a ready ``tokenizers.Tokenizer``
    Tokenizer = require("tokenizers", "hf", "TokenizerCorpus").Tokenizer
    tpath = Path(tokenizer)
    if not tpath.is_file():
        raise FileNotFoundError(f"tokenizer file does not exist: {tpath}")
    return Tokenizer.from_file(str(tpath))


class TokenizerCorpus(Corpus):
    """Tokens from a Hugging Face ``tokenizer.json`` (or a ``tokenizers.Tokenizer``).

    Documents are gathered exactly as for :class:`ByteCorpus` (``max_bytes``
    caps the raw text), encoded one by one and concatenated, with
    ``separator_id`` between documents when given.
    """

    def __init__(self, path: str | os.PathLike[str] | None, tokenizer: Any, *,
                 kind: str = "auto", pattern: str | None = None, text_field: str = "text",
                 max_bytes: int | None = DEFAULT_MAX_BYTES,
                 separator_id: int | None = None) -> None:
        tok = _load_tokenizer(tokenizer)
        p = None if path is None else Path(path)
        docs, name = _named_documents(p, kind, pattern=pattern, text_field=text_field)
        vocab = int(tok.get_vocab_size(with_added_tokens=True))
        ids: list[int] = []
        total = 0
        for where, doc in docs:
            if max_bytes is not None and total >= max_bytes:
                break
            cut = max_bytes is not None and len(doc) > max_bytes - total
            if cut:
                doc = doc[: max_bytes - total]
            total += len(doc)
            text = decode_utf8(doc, where, cut_at_end=cut)    # strict: bytes that are not UTF-8 are refused
            if not text:
                continue
            if ids and separator_id is not None:
                ids.append(int(separator_id))
            ids.extend(tok.encode(text, add_special_tokens=False).ids)
        if not ids:
            raise ValueError(f"corpus {p if p is not None else name} is empty (0 tokens)")
        dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.int32
        super().__init__(np.asarray(ids, dtype=dtype), vocab, f"{name}+tokenizer")
        self.tokenizer = tok

    def decode(self, tokens: Any) -> str:
        """Detokenize a sequence of ids."""
        arr = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
        return self.tokenizer.decode([int(t) for t in arr.reshape(-1)])


def load_corpus(path: str | os.PathLike[str] | None = None, *, kind: str = "auto",
                tokenizer: Any = None, max_bytes: int | None = DEFAULT_MAX_BYTES,
                pattern: str | None = None, text_field: str = "text") -> Corpus:
    """Load a token corpus.

    ``path=None`` → the standard library source (bytes).  Otherwise ``kind``
    ``"auto"`` picks ``"dir"`` (``*.txt`` files, or ``pattern``), ``"jsonl"``
    (``text_field`` of each line) or ``"text"`` (one file) from the path; ``"stdlib"``
    treats ``path`` as a Python source tree.  With ``tokenizer`` (a
    ``tokenizer.json`` path or ``tokenizers.Tokenizer``) returns a
    :class:`TokenizerCorpus`, otherwise a :class:`ByteCorpus`.

    Raises FileNotFoundError for a missing path and ValueError for an empty corpus.
    """
    if tokenizer is not None:
        return TokenizerCorpus(path, tokenizer, kind=kind, pattern=pattern,
                               text_field=text_field, max_bytes=max_bytes)
    return ByteCorpus(path, kind=kind, pattern=pattern, text_field=text_field,
                      max_bytes=max_bytes)
