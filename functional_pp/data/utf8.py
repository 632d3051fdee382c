"""The one UTF-8 decoder of the data path: every data file (JSON lines, JSON arrays, plain text,
chat templates, tokenizer settings) is decoded here, strictly. Bytes that are not UTF-8 are
refused naming the file, the line (or record), the byte offset in the file, the column and
the byte, and how to convert the file; nothing is replaced silently (a ``U+FFFD`` in the
training text would train tokens the data never held). A UTF-8 byte-order mark at the start of
a file is not text and is dropped (it would train a ``U+FEFF`` token, and JSON refuses it)."""
from __future__ import annotations

from pathlib import Path

__all__ = ["Utf8Error", "decode", "read_text"]

BOM = b"\xef\xbb\xbf"
FIX = "convert the file to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 FILE > FILE.utf8, naming its real encoding)"


class Utf8Error(ValueError):
    """Bytes of a data file that are not UTF-8; the message names where and how to fix."""


def decode(raw: bytes, path: str | Path, *, line: int | None = None, record: int | None = None,
           offset: int = 0, cut_at_end: bool = False) -> str:
    """``raw`` (the bytes of ``path`` starting at byte ``offset``; of line ``line`` or record
    ``record`` when given) as text. ``cut_at_end``: ``raw`` was cut at a byte limit, so an
    incomplete character at its very end is dropped instead of refused."""
    if offset == 0 and raw.startswith(BOM):
        raw, offset = raw[len(BOM):], len(BOM)          # the byte-order mark editors write is not text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if cut_at_end and exc.reason == "unexpected end of data" and exc.end == len(raw):
            return raw[: exc.start].decode("utf-8")
        start = exc.start
        if line is None:                        # a whole file: count the lines before the byte
            line = raw.count(b"\n", 0, start) + 1 if record is None else None
            column = start - (raw.rfind(b"\n", 0, start) + 1) + 1
        else:
            column = start + 1
        where = f"line {line}" if line is not None else f"record {record}"
        utf16 = " (it starts with a UTF-16 byte-order mark: the file is UTF-16)" if (
            offset == 0 and raw[:2] in (b"\xff\xfe", b"\xfe\xff")) else ""
        raise Utf8Error(f"{path}: {where}: not UTF-8 (byte {raw[start]:#04x} at byte offset {offset + start} "
                        f"of the file, column {column}){utf16}; {FIX}") from None


def read_text(path: str | Path) -> str:
    """The whole file ``path`` as text (strict UTF-8, see :func:`decode`)."""
    return decode(Path(path).read_bytes(), path)
