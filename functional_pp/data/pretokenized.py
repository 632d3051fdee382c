"""Pretokenized datasets: ``.npy`` arrays and raw ``.bin`` token ids, memory-mapped (never
loaded whole), with the checks that a raw file is read at the width it was written with (a
``.bin`` of uint32 ids read as uint16 doubles the tokens, every second one 0, silently)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

WIDTHS = ("uint16", "uint32", "int32")
HEAD = 1 << 20          # tokens read to check the width and the ids (a memory map stays unread beyond)


def default_width(vocab: int | None) -> str:
    """The ``.bin`` token dtype when a dataset names none: uint16 when every id of a ``vocab``-token
    vocabulary fits in it (or no tokenizer says), else uint32."""
    return "uint16" if vocab is None or vocab <= 1 << 16 else "uint32"


def token_ids(entry: Any, vocab: int | None, where: str) -> np.ndarray:
    """The token ids of pretokenized dataset ``entry`` (a ``DatasetConfig``) as a 1-D memory map,
    refused (naming ``where``, the file and the fix) when the file is not a whole number of
    tokens of its dtype, or when its first tokens show another width or ids outside the
    tokenizer's ``vocab`` (None: no tokenizer given, the model's vocabulary bounds the ids)."""
    path = Path(entry.path)
    if path.suffix.lower() == ".npy":
        arr = np.load(path, mmap_mode="r")
    else:
        width = entry.dtype or default_width(vocab)
        if width not in WIDTHS:
            raise ValueError(f"{where}: dtype {width!r}: choose one of {' | '.join(WIDTHS)}")
        dtype, size = np.dtype(width), path.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(f"{where}: {path} has {size} bytes, not a whole number of {width} tokens "
                             f"({dtype.itemsize} bytes each): set the dtype it was written with "
                             f"(dtype: {' | '.join(WIDTHS)})")
        if dtype.itemsize == 2 and vocab is not None and vocab > 1 << 16:
            raise ValueError(f"{where}: dtype {width} cannot hold the ids of the tokenizer's {vocab}-token "
                             f"vocabulary: {path} was written as uint32 (dtype: uint32) or with another tokenizer")
        arr = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where}: {path} must hold a 1-D integer array of token ids, got "
                         f"{arr.dtype} {arr.shape}")
    _check_head(np.asarray(arr[:HEAD]), vocab, path, where)
    return arr


def _check_head(head: np.ndarray, vocab: int | None, path: Path, where: str) -> None:
    """Refuse a file whose first tokens are wider ids read as 16-bit halves (every second one 0:
    little-endian uint32 read as uint16) or hold ids outside ``0..vocab-1`` (negative ones when no
    ``vocab`` is known)."""
    if head.dtype.itemsize == 2 and len(head) >= 8 and len(head) % 2 == 0 and not head[1::2].any() \
            and head[0::2].any():
        raise ValueError(f"{where}: every second 16-bit token of {path} is 0, as in uint32 ids read as "
                         f"{head.dtype}: set dtype: uint32 (the file would train {len(head) // 2} tokens "
                         f"of its first {len(head)} as id 0)")
    bad = np.flatnonzero((head < 0) if vocab is None else (head < 0) | (head >= vocab))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{where}: token {i} of {path} is id {int(head[i])}, outside the tokenizer's "
                         f"vocabulary of {vocab}: the file was written with another dtype (a uint16 file "
                         f"read as {head.dtype} gives ids above 65535; dtype: {' | '.join(WIDTHS)}) or "
                         f"another tokenizer")
