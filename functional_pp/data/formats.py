"""``datasets:`` entries (Axolotl's shape) read into one token stream for the loader.

Each entry yields *examples*: token ids and, for instruction data, which tokens are trained.
:func:`build_streams` tokenizes them, holds out ``val_set_size`` examples, and joins each
split into a :class:`TokenStream`: the examples back to back with EOS after each (packing),
or each one alone in a row of ``sequence_len`` tokens padded with EOS (no packing). The loader
turns a stream into batches whose labels are -100 on untrained tokens and at document ends,
and whose ``segments`` keep attention inside each document (``docs/data.md``).

Formats: ``text`` (a file or a directory of files, each one document), ``completion`` (jsonl /
json / parquet / HF ``load_from_disk`` records, ``field``), ``alpaca`` (instruction, input,
output; only the output is trained), ``chat_template`` (a list of messages; only the roles in
``roles_to_train`` are trained), ``pretokenized`` (``.npy`` or raw ``.bin`` token ids, memory
mapped, never loaded whole).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import numpy as np

from functional_pp.core.optional import require
from functional_pp.data.dedup import ExactDuplicates
from functional_pp.data.chat import DEFAULT_ROLES, ChatSpec, resolve_template, sample_text, tokenize_chat
from functional_pp.data.pretokenized import token_ids
from functional_pp.data.progress import Progress
from functional_pp.data.tokenizer import CHATML
from functional_pp.data.utf8 import decode as _utf8

__all__ = ["TokenStream", "ByteTokenizer", "build_streams", "ALPACA_PROMPT", "ALPACA_PROMPT_NO_INPUT"]

_SYSTEM = ("Below is an instruction that describes a task, paired with an input that provides further "
           "context. Write a response that appropriately completes the request.")
_SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
#: Axolotl's alpaca prompt styles: (system format, turn with input, turn without input)
ALPACA_STYLES = {
    "alpaca": ("{system}\n\n", "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
               "### Instruction:\n{instruction}\n\n### Response:\n"),
    "alpaca:chat": ("SYSTEM: {system}\n", "USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:"),
    "alpaca:chatml": ("<|im_start|>system\n{system}<|im_end|>\n",
                      "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
                      "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"),
    "alpaca:phi": ("<|system|>\n{system}<|end|>\n", "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
                   "<|user|>\n{instruction}<|end|>\n<|assistant|>\n"),
}
ALPACA_PROMPT = _SYSTEM + "\n\n" + ALPACA_STYLES["alpaca"][1]
ALPACA_PROMPT_NO_INPUT = _SYSTEM_NO_INPUT + "\n\n" + ALPACA_STYLES["alpaca"][2]
EXCESS_LENGTH_STRATEGIES = ("drop", "truncate", "raise")   # Axolotl's; drop by default (unpacked rows)
TYPES = ("text", "completion", *ALPACA_STYLES, "input_output", "chat_template", "pretokenized")


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256); byte 0 is the end-of-document token."""

    vocab_size, bos_id, eos_id, add_bos, chat_template = 256, None, 0, False, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_as_transformers = encode          # (no special tokens to add)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets = [], []
        for i, ch in enumerate(text):
            b = ch.encode("utf-8")
            ids += list(b)
            offsets += [(i, i + 1)] * len(b)
        return ids, offsets

    def token_to_id(self, text: str) -> int | None:
        b = text.encode("utf-8")
        return b[0] if len(b) == 1 else None

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in np.asarray(ids).reshape(-1)).decode("utf-8", errors="replace")

    def render(self, messages: list[dict], template: str | None) -> str:
        from functional_pp.data.chat import render
        return render(template or CHATML, messages, {})[0]

    special_tokens: dict = {}
    chat_eos_id = None          # no EOS text: chat data trains no end-of-turn token


@dataclass
class TokenStream:
    """Token ids back to back (``tokens``, possibly a memory map), which of them are trained
    as labels (``trained``, None: all), the end-of-document id and, where examples hold that id
    inside them, where each document starts (``starts``: an EOS inside an example does not end it)."""

    tokens: np.ndarray
    trained: np.ndarray | None
    eos_id: int | None
    vocab_size: int
    name: str
    documents: int
    stats: list = field(default_factory=list)      # DatasetStats of each datasets entry
    prepared: str = ""                             # dataset_prepared_path: reused or saved (data/prepared.py)
    images: Any = None                             # each row's images (data/vision_chat.py's RowImages) or None
    # 1 at each document's first token, where an example holds the EOS id inside it (a chat template's
    # turn end that is also the model's EOS: Qwen's <|im_end|>, Mistral's </s>); None: each EOS ends one
    starts: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


# --------------------------------------------------------------------------- records
_SLICE = re.compile(r"^(?P<name>[\w.-]+)(?:\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?$")


def parse_split(split: str, where: str) -> tuple[str, str | None, str | None]:
    """``"train[10%:50%]"`` (HF datasets' slice notation: rows or percentages) -> ``("train",
    "10%", "50%")``; a plain name -> ``(name, None, None)``."""
    m = _SLICE.match(split.replace(" ", ""))
    if m is None:
        raise ValueError(f"{where}: split {split!r} is not a split name or a slice of one such as "
                         f"'train[:20%]' or 'train[100:200]'")
    return m["name"], m["start"], m["stop"]


def _bound(b: str | None, n: int) -> int | None:
    """A slice bound of :func:`parse_split` as a row index of ``n`` rows (a percentage rounded to
    the closest row, as HF datasets does)."""
    if b is None:
        return None
    return round(n * int(b[:-1]) / 100) if b.endswith("%") else int(b)


def _records(path: Path, ds_type: str | None, split: str, where: str) -> Iterator[dict]:
    """Records of a jsonl / json / parquet file or a HF ``datasets`` directory; a sliced split
    (``train[:20%]``) keeps those rows."""
    name, start, stop = parse_split(split, where)
    if start is None and stop is None:
        yield from _split_records(path, ds_type, name, where)
        return
    rows = list(_split_records(path, ds_type, name, where))
    yield from rows[_bound(start, len(rows)):_bound(stop, len(rows))]


def _split_records(path: Path, ds_type: str | None, split: str, where: str) -> Iterator[dict]:
    kind = ds_type or ("arrow" if path.is_dir() else path.suffix.lower().lstrip("."))
    if kind != "arrow" and split != "train":            # (a file holds one split: HF datasets calls it train)
        raise ValueError(f"{where}: split {split!r}: {path} is one file, read whole as the split 'train'; "
                         f"remove split, slice train (e.g. 'train[:20%]'), or point path at the file of that split")
    if kind in ("jsonl", "json"):
        at = where if str(path) in where else f"{where}: {path}"
        with open(path, "rb") as f:
            if kind == "json" and f.read(4096).lstrip().startswith(b"["):
                f.seek(0)
                text = _utf8(f.read(), at)                               # a JSON array: read whole
                try:
                    records = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{at}: not a JSON array of records ({exc})") from exc
                yield from records
                return
            f.seek(0)
            offset = 0
            for lineno, raw in enumerate(f, start=1):     # JSON lines: one record at a time
                line = _utf8(raw, at, line=lineno, offset=offset)
                offset += len(raw)
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{at}: line {lineno}: invalid JSON ({exc.msg})") from exc
    elif kind == "parquet":
        pq = require("pyarrow.parquet", "data", f"{where}: reading the Parquet file {path}")
        yield from pq.read_table(str(path)).to_pylist()
    elif kind == "arrow":
        _require_saved_dataset(Path(path), where)
        load_from_disk = require("datasets", "data", f"{where}: reading {path}, a directory of a HF dataset "
                                 f"(load_from_disk),").load_from_disk
        ds = load_from_disk(str(path))
        if hasattr(ds, "keys"):
            if split not in ds:
                raise ValueError(f"{where}: {path} has splits {list(ds.keys())}, not {split!r}; set split")
            ds = ds[split]
        yield from ds
    else:
        raise ValueError(f"{where}: cannot read records from {path} (ds_type {kind!r}); use "
                         f".jsonl, .json, .parquet or a datasets directory, or set ds_type")


_SAVED_DATASET_FILES = ("dataset_dict.json", "state.json")   # what save_to_disk writes (a dict / one split)


def _require_saved_dataset(path: Path, where: str) -> None:
    """Refuse a directory that ``save_to_disk`` did not write (a folder of data files: datasets'
    own message named neither the files nor the fix), naming the data files it holds."""
    if any((path / name).is_file() for name in _SAVED_DATASET_FILES):
        return
    data = sorted(p.name for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet", ".txt")
                  and not any(w in p.name for w in ("config", "tokenizer", "index")))   # (a model's files)
    fix = (f"; it holds {', '.join(data[:4])}{' ...' if len(data) > 4 else ''}: give each file as a datasets "
           f"entry of its own (path: {path / data[0]})" if data else "; point path at a data file")
    raise ValueError(f"{where}: {path} is a directory but not a Hugging Face dataset written by save_to_disk "
                     f"(no {' or '.join(_SAVED_DATASET_FILES)}){fix}")


def _field(rec: Any, key: str, where: str, n: int) -> Any:
    if not isinstance(rec, dict) or key not in rec:
        have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise ValueError(f"{where}: record {n} has no field {key!r} (it has {have})")
    return rec[key]


def _text_field(rec: Any, key: str, where: str, n: int, optional: bool = False) -> str:
    """Field ``key`` of record ``n`` as text: a string, or a number written out; null, lists and
    mappings are refused naming the record (``"output": null`` would train the text "None")."""
    value = _field(rec, key, where, n)
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 80 else shown[:80] + " ..."
    what = "null" if value is None else f"{type(value).__name__} {shown}"
    fix = "give it text" + (" or leave it out" if optional else " or remove the record")
    raise ValueError(f"{where}: record {n}: field {key!r} is {what}, not text; {fix}")


# --------------------------------------------------------------------------- examples
Example = tuple[list[int], list[int] | None]        # ids, trained flags (None: all)


def _with_bos(tok, ids: list[int], mask: list[int] | None) -> Example:
    if tok.add_bos and tok.bos_id is not None:
        return [tok.bos_id, *ids], (None if mask is None else [0, *mask])
    return ids, mask


def _alpaca(tok, rec: dict, style: str, train_inputs: bool, where: str, n: int) -> Example:
    """Axolotl's alpaca prompt in ``style`` (``alpaca``, ``alpaca:chat``, ``alpaca:phi``, ...):
    the output trained, the prompt only with ``train_on_inputs``."""
    system, turn, turn_no_input = ALPACA_STYLES[style]
    instruction = _text_field(rec, "instruction", where, n)
    inp = _text_field(rec, "input", where, n, optional=True) if rec.get("input") is not None else ""
    prompt = (system.format(system=_SYSTEM) + turn if inp else
              system.format(system=_SYSTEM_NO_INPUT) + turn_no_input).format(instruction=instruction, input=inp)
    p, r = tok.encode(prompt), tok.encode(_text_field(rec, "output", where, n))
    return _with_bos(tok, p + r, [int(train_inputs)] * len(p) + [1] * len(r))


def _input_output(tok, rec: dict, where: str, n: int) -> Example:
    """Axolotl's template-free ``input_output``: ``segments`` of ``{text, label}``, each
    segment's tokens trained when its label is true (the texts carry their own markers)."""
    segments = _field(rec, "segments", where, n)
    if not isinstance(segments, list) or not all(isinstance(s, dict) and isinstance(s.get("text"), str)
                                                 for s in segments):
        raise ValueError(f"{where}: record {n}: segments must be a list of {{text, label}}, got {segments!r}")
    ids: list[int] = []
    mask: list[int] = []
    for s in segments:
        part = tok.encode(s["text"])
        ids += part
        mask += [int(bool(s.get("label", True)))] * len(part)
    return _with_bos(tok, ids, mask)


def chat_spec(entry, tok, *, train_inputs: bool, default_template: str | None,
              default_jinja: str | None = None, eot_tokens: list | None = None,
              template_kwargs: dict | None = None, where: str = "datasets[0]") -> ChatSpec:
    """How ``entry`` (a ``type: chat_template`` DatasetConfig) reads its conversations, as
    Axolotl's chat_template strategy: the template (the entry's, else the top-level
    ``chat_template``; none named: the tokenizer's, else ChatML), the message keys, the role
    map, the trained roles and end-of-turn tokens."""
    choice = getattr(entry, "chat_template", None)
    jinja = getattr(entry, "chat_template_jinja", None)
    key = f"{where}.chat_template"
    if not choice:
        choice, jinja, key = default_template, default_jinja, "chat_template"
    own = getattr(tok, "chat_template", None)
    if hasattr(tok, "encode_chat"):          # mistral-common: its own chat encoding, no template
        if choice not in (None, "tokenizer_default"):
            raise ValueError(f"{key}: {choice!r}: a mistral-common tokenizer encodes chats itself "
                             f"(tokenizer_use_mistral_common); remove {key}")
        template, name = "", "mistral-common's chat encoding"
    elif choice is None:
        template, name = (own, "the tokenizer's chat_template") if own else (CHATML, "chatml")
    else:
        try:
            template, name = resolve_template(choice, jinja, own, key)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    mappings = dict(getattr(entry, "message_property_mappings", None) or {})
    given = bool(mappings)
    role_key, content_key = getattr(entry, "message_field_role", None), getattr(entry, "message_field_content", None)
    for k, v in (("role", role_key), ("content", content_key)):
        if v is not None:
            if k in mappings and mappings[k] != v:
                raise ValueError(f"{where}: message_field_{k}: {v!r} contradicts "
                                 f"message_property_mappings.{k}: {mappings[k]!r}; give one")
            mappings[k], given = v, True
    mappings = {"role": "role", "content": "content", **mappings}
    roles = getattr(entry, "roles", None)
    role_map = ({s: t for t, sources in roles.items() for s in ([sources] if isinstance(sources, str) else sources)}
                if roles else dict(DEFAULT_ROLES))
    to_train = getattr(entry, "roles_to_train", None)
    to_train = ["assistant"] if to_train is None else list(to_train)
    specials = dict(getattr(tok, "special_tokens", {}) or {})
    eos_id = getattr(tok, "chat_eos_id", tok.eos_id)
    if eot_tokens and not hasattr(tok, "encode_chat"):   # (mistral-common: the turn ends at EOS, as Axolotl)
        eot = []
        for t in eot_tokens:
            if t not in template:          # Axolotl drops end-of-turn tokens its template lacks
                continue
            i = tok.token_to_id(t) if hasattr(tok, "token_to_id") else None
            if i is None:
                raise ValueError(f"eot_tokens: {t!r} is not one token of the tokenizer")
            eot.append(i)
    else:
        eot = [] if eos_id is None else [eos_id]
    warning = ""
    eos_text = specials.get("eos_token")
    if not eot_tokens and template and eos_text and eos_text not in template and "eos_token" not in template:
        warning = (f"the tokenizer's EOS {eos_text!r} is not in the chat template: no end-of-turn "
                   f"token is trained (as Axolotl); set eot_tokens to the template's turn end")
    return ChatSpec(template=template, template_name=name, warning=warning,
                    field_messages=getattr(entry, "field_messages", None) or "messages",
                    mappings=mappings, mappings_given=given, roles=role_map,
                    roles_to_train=tuple(role_map.get(r, r) for r in to_train),
                    train_on_inputs=train_inputs,
                    train_on_eos=getattr(entry, "train_on_eos", "turn"),
                    train_on_eot=getattr(entry, "train_on_eot", None), eot_ids=tuple(eot),
                    eos_id=eos_id, drop_system_message=bool(getattr(entry, "drop_system_message", False)),
                    field_system=getattr(entry, "field_system", None) or "system",
                    message_field_training=getattr(entry, "message_field_training", None),
                    thinking=(getattr(entry, "template_thinking_key", None) or "reasoning_content",
                              getattr(entry, "field_thinking", None) or "reasoning_content"),
                    special_tokens=specials, template_kwargs=dict(template_kwargs or {}))


def _chat(tok, rec: dict, spec: ChatSpec, where: str, n: int) -> Example:
    try:
        return tokenize_chat(tok, rec, spec)
    except ValueError as exc:
        raise ValueError(f"{where}: record {n}: {exc}") from exc


def _text_files(path: Path, pattern: str | None) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob(pattern or "*.txt") if p.is_file())


def _items(entry, where: str) -> Iterator[Any]:
    """An entry's raw examples: files (``text``) or records."""
    path = Path(entry.path)
    kind = entry.type or _guess_type(path, entry.ds_type)
    if kind not in TYPES:
        raise ValueError(f"{where.split(' ', 1)[0]}.type {kind!r} is not supported (choose {', '.join(TYPES)})")
    if kind == "text":
        files = _text_files(path, entry.pattern)
        if not files:
            raise ValueError(f"{where}: no files matching {entry.pattern or '*.txt'!r} in {path}")
        yield from files
    else:
        yield from _records(path, entry.ds_type, entry.split, where)


def _examples(entry, tok, train_inputs: bool, spec: ChatSpec | None,
              where: str) -> Iterator[tuple[list[int], list[int] | None, Any]]:
    """``(ids, trained flags or None: all, the raw record)`` of each example of ``entry``."""
    kind = entry.type or _guess_type(Path(entry.path), entry.ds_type)
    if kind == "text":
        for f in _items(entry, where):
            at = where if str(f) in where else f"{where}: {f}"
            yield (*_with_bos(tok, tok.encode(_utf8(f.read_bytes(), at)), None), f)
        return
    for n, rec in enumerate(_items(entry, where), start=1):
        if kind == "completion":
            if entry.type is None and isinstance(rec, dict) and entry.field not in rec:
                _refuse_untyped(rec, entry.field, where, n)
            text = _field(rec, entry.field, where, n)
            if not isinstance(text, str):
                raise ValueError(f"{where}: record {n}: field {entry.field!r} is "
                                 f"{type(text).__name__}, not text")
            yield (*_with_bos(tok, tok.encode(text), None), rec)
        elif kind in ALPACA_STYLES:
            yield (*_alpaca(tok, rec, kind, train_inputs, where, n), rec)
        elif kind == "input_output":
            yield (*_input_output(tok, rec, where, n), rec)
        else:
            assert spec is not None
            yield (*_chat(tok, rec, spec, where, n), rec)


def _refuse_untyped(rec: dict, field: str, where: str, n: int) -> None:
    """A record of a dataset without ``type`` (read as completion text) that lacks the text field:
    named with the type its fields look like."""
    keys = set(rec)
    kind = ("alpaca" if {"instruction", "output"} <= keys else
            "chat_template" if keys & {"messages", "conversations"} else
            "input_output" if "segments" in keys else None)
    key = where.split(" ", 1)[0]
    hint = (f"its fields look like type {kind}: set {key}.type: {kind}" if kind else
            f"set {key}.type ({', '.join(TYPES)}), or {key}.field: the name of the text field")
    raise ValueError(f"{where}: record {n} has no field {field!r} (it has {sorted(rec)}); the dataset has no type, "
                     f"so it is read as completion text from field {field!r}: {hint}")


def _guess_type(path: Path, ds_type: str | None) -> str:
    if path.suffix.lower() in (".npy", ".bin"):
        return "pretokenized"
    if path.is_dir() and not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
        return "text"
    if path.suffix.lower() in (".txt", ".md") or ds_type == "text":
        return "text"
    return "completion"


# --------------------------------------------------------------------------- streams
class _StreamWriter:
    """Appends examples (EOS after each; ``row``: one example per row of that many tokens,
    padded with EOS) to token / trained-flag buffers that spill to an unlinked temporary file
    past ``spill_bytes``, so memory stays bounded whatever the corpus size."""

    def __init__(self, eos: int, vocab: int, row: int | None, name: str, spill_bytes: int):
        self.eos, self.row, self.name, self.vocab = eos, row, name, vocab
        self.dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
        self.spill = spill_bytes
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.inner_eos = False                    # an example holds the EOS id before its end: starts kept
        self.pending = 0
        self.files = None
        self.n = 0
        self.documents = 0
        self.all_trained = True
        self.row_images: list = []                # (one example per row) each row's images or None

    def length(self, ids: list[int], eos_trained: bool = True) -> int:
        """How many tokens :meth:`add` writes for ``ids`` (with its EOS, before padding)."""
        return len(ids) + int(eos_trained or not ids or ids[-1] != self.eos)

    def add(self, ids: list[int], mask: list[int] | None, eos_trained: bool = True, cut: int | None = None,
            images: Any = None) -> int:
        """One example and the EOS after it, trained unless ``eos_trained`` is false (chat data:
        Axolotl trains no token its template did not write; an example that already ends with
        EOS gets none more). ``cut``: keep only that many tokens, the last of them an untrained
        EOS (the text went on: no end is trained where the cut fell, also not inside a prompt).
        Returns how many of its tokens the loader trains as labels (a trained token whose input
        is not EOS; a document's first token never is)."""
        m = [1] * len(ids) if mask is None else list(mask)
        ids = list(ids)
        if eos_trained or not ids or ids[-1] != self.eos:
            ids, m = ids + [self.eos], m + [int(eos_trained)]
        if cut is None and self.row is not None and len(ids) > self.row:
            cut = self.row                        # (build_streams drops or cuts such rows first)
        if cut is not None and len(ids) > cut:
            ids, m = ids[:cut - 1] + [self.eos], m[:cut - 1] + [0]
        self.inner_eos |= self.eos in ids[:-1]
        trained = sum(m[1:])                      # (the document's first token is never a label)
        st = [1] + [0] * (len(ids) - 1)
        if self.row is not None:                  # (each padding EOS a document of its own, as after any EOS)
            pad = self.row - len(ids)
            ids, m, st = ids + [self.eos] * pad, m + [0] * pad, st + [1] * pad
        self._put(np.asarray(ids, dtype=self.dtype), np.asarray(m, dtype=np.uint8), np.asarray(st, dtype=np.uint8))
        self.documents += 1
        if self.row is not None:
            self.row_images.append(images)
        return trained

    def _put(self, ids: np.ndarray, m: np.ndarray, st: np.ndarray) -> None:
        self.all_trained &= bool(m.all())
        self.parts.append((ids, m, st))
        self.pending += ids.nbytes + m.nbytes + st.nbytes
        self.n += len(ids)
        if self.pending >= self.spill:
            self._flush()

    def _flush(self) -> None:
        import tempfile
        if not self.parts:
            return
        if self.files is None:
            self.files = [tempfile.TemporaryFile(prefix="fpp-tokens-"), tempfile.TemporaryFile(prefix="fpp-mask-"),
                          tempfile.TemporaryFile(prefix="fpp-starts-")]
        for f, k in zip(self.files, (0, 1, 2)):
            f.write(np.concatenate([p[k] for p in self.parts]).tobytes())
        self.parts, self.pending = [], 0

    def finish(self) -> TokenStream:
        if self.row is not None:                  # the loader's windows overlap by one token
            self._put(np.asarray([self.eos], self.dtype), np.zeros(1, np.uint8), np.ones(1, np.uint8))
        if self.files is None:
            tokens = np.concatenate([p[0] for p in self.parts]) if self.parts else np.zeros(0, self.dtype)
            trained = np.concatenate([p[1] for p in self.parts]) if self.parts else np.zeros(0, np.uint8)
            starts = np.concatenate([p[2] for p in self.parts]) if self.parts else np.zeros(0, np.uint8)
        else:
            self._flush()
            for f in self.files:
                f.flush()
            tokens = np.memmap(self.files[0], dtype=self.dtype, mode="r", shape=(self.n,))
            trained = np.memmap(self.files[1], dtype=np.uint8, mode="r", shape=(self.n,))
            starts = np.memmap(self.files[2], dtype=np.uint8, mode="r", shape=(self.n,))
        return TokenStream(tokens, None if self.all_trained else trained, self.eos, self.vocab,
                           self.name, self.documents, starts=starts if self.inner_eos else None)


def held_out_count(val_set_size: float, n: int) -> int:
    """How many of ``n`` examples a ``val_set_size`` holds out: a count when >= 1, else a
    fraction (at least one)."""
    if val_set_size <= 0:
        return 0
    return int(val_set_size) if val_set_size >= 1 else max(1, int(round(n * val_set_size)))


def split_held_out(items: Any, val_set_size: float, seed: int, what: str) -> tuple[Any, Any]:
    """``items.split(n_val, seed)`` for the examples ``val_set_size`` holds out (``what`` names
    them: "pairs", "prompts"); a ValueError when nothing would be left to train on."""
    n_val = held_out_count(val_set_size, len(items))
    if n_val >= len(items):
        raise ValueError(f"val_set_size={val_set_size} holds out {n_val} of {len(items)} {what}: nothing is "
                         f"left to train on")
    return items.split(n_val, seed)


def build_streams(entries: list, tokenizer: Any, *, seq_len: int, sample_packing: bool = True,
                  val_set_size: float = 0.0, seed: int = 0, train_on_inputs: bool = False,
                  chat_template: str | None = None, chat_template_jinja: str | None = None,
                  eot_tokens: list | None = None, chat_template_kwargs: dict | None = None,
                  spill_bytes: int = 64 << 20, excess_length_strategy: str | None = None,
                  min_trained_share: float = 0.5, min_sample_len: int | None = None,
                  deduplicate: bool = False, progress_stream: TextIO | None = None,
                  clock: Callable[[], float] = time.monotonic,
                  vision: dict | None = None) -> tuple[TokenStream, TokenStream | None]:
    """``(train, validation or None)`` streams from ``datasets:`` entries (DatasetConfig).
    Examples are tokenized one at a time; past ``spill_bytes`` the streams live in unlinked
    temporary files, memory-mapped (bounded memory for corpora of any size).

    Rows with no trained token are counted per dataset (``train.stats``); when fewer than
    ``min_trained_share`` of a dataset's rows train any token, it raises naming the dataset, a
    sample row and the role mapping used: the data would train nothing (or the wrong thing).

    ``excess_length_strategy`` (Axolotl's) for an example longer than ``seq_len`` (with its EOS):
    ``drop`` it, ``truncate`` it (its last kept token an untrained EOS: nothing is trained where
    the cut fell), ``raise`` naming the file, record, length and ``seq_len``; None: ``drop`` for
    unpacked rows, packed documents continue in the next window. Each is counted per dataset
    (``DatasetStats``), and the trained-token count is the number of labels the loader trains.

    A preparation longer than a few seconds prints its progress (rows, tokens, rates) to
    ``progress_stream`` (default: stderr on the first process; ``data/progress.py``).

    ``min_sample_len`` (Axolotl's): a row of fewer tokens (with its EOS) is left out and counted.
    ``deduplicate`` (Axolotl's ``dataset_exact_deduplication``): a row equal to an earlier one of
    any dataset (the same tokens and trained positions) is left out and counted.

    ``vision`` (``processor_type``: a vision-language model): ``{"processor": transformers'
    processor, "patch": ..., "merge": ..., "image_token_id": ...}``; chat records are encoded by
    the processor with their images (data/vision_chat.py), one per row (no packing), and each
    stream holds its rows' images (``TokenStream.images``)."""
    tok = tokenizer or ByteTokenizer()
    repeats = ExactDuplicates(deduplicate)
    eos = tok.eos_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token (eos_token_id in config.json or "
                         "eos_token in tokenizer_config.json): documents could not be separated")
    vocab = int(tok.vocab_size)
    names = ", ".join(Path(e.path).name for e in entries)
    memmaps = [i for i, e in enumerate(entries)
               if (e.type or _guess_type(Path(e.path), e.ds_type)) == "pretokenized"]
    if memmaps:
        if len(entries) > 1:
            raise ValueError("a pretokenized (.npy / .bin) dataset must be the only entry of "
                             "datasets (it is memory-mapped, not copied); concatenate the others "
                             "into it")
        arr = token_ids(entries[0], vocab if tokenizer is not None else None, f"datasets[0] ({entries[0].path})")
        n_docs = _count(arr, eos)
        n_val = held_out_count(val_set_size, max(n_docs, 1))
        cut = _cut_before_last_docs(arr, eos, n_val) if n_val else len(arr)
        train = TokenStream(arr[:cut], None, eos, vocab, names, n_docs - n_val)
        val = TokenStream(arr[cut:], None, eos, vocab, f"{names}[val]", n_val) if n_val else None
        return train, val
    counts = [sum(1 for _ in _items(e, f"datasets[{i}] ({e.path})")) for i, e in enumerate(entries)]
    n = sum(counts)
    if n == 0:
        raise ValueError(f"datasets ({names}) hold no examples")
    n_val = held_out_count(val_set_size, n)
    if n_val >= n:
        raise ValueError(f"val_set_size={val_set_size} holds out {n_val} of {n} examples: "
                         f"nothing is left to train on")
    val_idx = set(np.random.default_rng([seed, 7]).permutation(n)[n - n_val:].tolist()) if n_val else set()
    if vision is not None and sample_packing:
        raise ValueError("sample_packing: true with images (processor_type): rows with images are not packed "
                         "(Axolotl sets sample_packing: false for them); set sample_packing: false")
    row = None if sample_packing else seq_len
    strategy = excess_length_strategy or (None if sample_packing else "drop")
    if strategy not in (None, *EXCESS_LENGTH_STRATEGIES):
        raise ValueError(f"excess_length_strategy {strategy!r}: choose {' / '.join(EXCESS_LENGTH_STRATEGIES)}")
    train = _StreamWriter(eos, vocab, row, names, spill_bytes)
    val = _StreamWriter(eos, vocab, row, f"{names}[val]", spill_bytes) if n_val else None
    j = 0
    stats = []
    progress = Progress(f"preparing data ({names})", n, stream=progress_stream, clock=clock)
    for i, entry in enumerate(entries):
        where = f"datasets[{i}]"
        kind = entry.type or _guess_type(Path(entry.path), entry.ds_type)
        spec = chat_spec(entry, tok, train_inputs=train_on_inputs, default_template=chat_template,
                         default_jinja=chat_template_jinja, eot_tokens=eot_tokens,
                         template_kwargs=chat_template_kwargs, where=where) if kind == "chat_template" else None
        st = DatasetStats(where, str(entry.path), kind, spec.template_name if spec else None,
                          spec.describe_roles() if spec else "", spec.warning if spec else "", seq_len=seq_len)
        eos_trained = spec is None and kind != "input_output"
        if vision is not None and kind == "chat_template":     # (images: the model's processor renders them)
            records = _image_examples(entry, vision["processor"], f"{where} ({entry.path})")
        else:
            records = ((ids, mask, rec, None) for ids, mask, rec in
                       _examples(entry, tok, train_on_inputs, spec, f"{where} ({entry.path})"))   # errors name the file
        for n, (ids, mask, rec, images) in enumerate(records, start=1):
            length, cut = train.length(ids, eos_trained), None
            if min_sample_len is not None and length < min_sample_len:
                st.short += 1
                j += 1
                continue
            if images is None and repeats.is_repeat(ids, mask):
                st.duplicates += 1
                j += 1
                continue
            if length > seq_len:
                if strategy == "raise":
                    raise ValueError(f"{where} ({entry.path}): {_record_name(rec, n)} has {length} tokens "
                                     f"(with EOS), more than sequence_len={seq_len} (excess_length_strategy: "
                                     f"raise); raise sequence_len, shorten the row, or set "
                                     f"excess_length_strategy: drop or truncate")
                if strategy == "drop":
                    st.dropped += 1
                    j += 1
                    continue
                if strategy == "truncate":
                    st.truncated += 1
                    cut = seq_len
                else:                            # packed, unset: the document spans windows
                    st.spanning += 1
            if cut is not None and images is not None:
                raise ValueError(f"{where} ({entry.path}): {_record_name(rec, n)} has {length} tokens with its "
                                 f"image tokens, more than sequence_len={seq_len}: a row with images cannot be cut "
                                 f"(excess_length_strategy: truncate); raise sequence_len or use drop")
            trained = (val if j in val_idx else train).add(ids, mask, eos_trained=eos_trained and images is None,
                                                           cut=cut, images=images)
            j += 1
            st.rows += 1
            st.tokens += min(length, cut or length)
            st.trained_tokens += trained
            if trained == 0:
                st.untrained_rows += 1
                if st.sample is None:
                    st.sample = (rec, ids, mask)
            elif st.trained_sample is None and mask is not None:
                st.trained_sample = sample_text(tok, ids, mask)
            progress.update(j, sum(s.tokens for s in stats) + st.tokens)
        if (st.short or st.duplicates) and not st.rows and not st.dropped:
            raise ValueError(f"{where} ({entry.path}): every row was left out ({st.short} shorter than "
                             f"min_sample_len={min_sample_len}, {st.duplicates} repeating an earlier row "
                             f"(dataset_exact_deduplication)); lower min_sample_len or check the data")
        if st.dropped and not st.rows:
            raise ValueError(f"{where} ({entry.path}): all {st.dropped} rows are longer than sequence_len="
                             f"{seq_len} and were dropped (excess_length_strategy: drop); raise "
                             f"sequence_len, or set excess_length_strategy: truncate to train on their "
                             f"first {seq_len} tokens")
        if st.rows and st.rows - st.untrained_rows < min_trained_share * st.rows:
            raise ValueError(st.refusal(tok))
        stats.append(st)
    progress.finish()
    out = train.finish()
    out.stats = stats
    held = val.finish() if val is not None else None
    if vision is not None:
        from functional_pp.data.vision_chat import RowImages
        for stream, writer in ((out, train), (held, val)):
            if stream is not None:
                stream.images = RowImages(writer.row_images, vision["patch"], vision["merge"],
                                          vision["image_token_id"], vision.get("qwen"),
                                          class_token=vision.get("class_token"), image_size=vision.get("image_size"),
                                          siglip2=vision.get("siglip2"), groups=bool(vision.get("groups")))
    return out, held


def _image_examples(entry, processor, where: str) -> Iterator[tuple[list[int], list[int], Any, Any]]:
    """``(ids, trained flags, the record, its images)`` of each chat record of ``entry``, encoded by
    the model's processor (data/vision_chat.py); image paths are relative to the dataset's folder."""
    from functional_pp.data.vision_chat import encode
    base = Path(entry.path) if Path(entry.path).is_dir() else Path(entry.path).parent
    for n, rec in enumerate(_items(entry, where), start=1):
        ids, mask, images = encode(processor, rec, base, f"{where}: record {n}")
        yield ids, mask, rec, images


@dataclass
class DatasetStats:
    """Per dataset: rows, tokens, trained tokens, rows with no trained token (and one of them),
    one trained example decoded with its trained tokens marked ``[[...]]``."""

    where: str
    path: str
    kind: str
    template: str | None
    roles: str
    warning: str = ""
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    untrained_rows: int = 0
    sample: Any = None
    trained_sample: str | None = None
    dropped: int = 0
    truncated: int = 0
    spanning: int = 0                        # packed documents longer than sequence_len
    seq_len: int = 0
    short: int = 0                           # rows shorter than min_sample_len, left out
    duplicates: int = 0                      # rows equal to an earlier one, left out (deduplicate)

    def line(self) -> str:
        tpl = f", template {self.template}" if self.template else ""
        none = f", {self.untrained_rows} rows with no trained token" if self.untrained_rows else ""
        longer = f" rows longer than sequence_len={self.seq_len}"
        none += f", {self.dropped}{longer} dropped (excess_length_strategy: drop)" if self.dropped else ""
        none += (f", {self.truncated}{longer} truncated (excess_length_strategy: truncate)"
                 if self.truncated else "")
        none += f", {self.spanning}{longer} continue in the next window (packed)" if self.spanning else ""
        none += f", {self.short} rows shorter than min_sample_len left out" if self.short else ""
        none += (f", {self.duplicates} rows equal to an earlier one left out (dataset_exact_deduplication)"
                 if self.duplicates else "")
        warn = f"; note: {self.warning}" if self.warning else ""
        return (f"{self.where} {Path(self.path).name} ({self.kind}{tpl}): {self.rows} rows, "
                f"{self.tokens} tokens, {self.trained_tokens} trained{none}{warn}")

    def refusal(self, tok) -> str:
        rec, ids, mask = self.sample
        shown = json.dumps(rec, ensure_ascii=False, default=str) if not isinstance(rec, Path) else str(rec)
        if len(shown) > 600:
            shown = shown[:600] + " ..."
        rendered = tok.decode(ids, skip_special_tokens=False)
        if len(rendered) > 600:
            rendered = rendered[:600] + " ..."
        return (f"{self.where} ({self.path}): {self.untrained_rows} of {self.rows} rows have no "
                f"trained token, so training would learn nothing from them (template "
                f"{self.template}; {self.roles}). A sample row: {shown}\nrendered as: {rendered!r}\n"
                f"Check field_messages / message_property_mappings (ShareGPT: {{role: from, "
                f"content: value}}), roles and roles_to_train, or set train_on_inputs: true")


def _record_name(rec: Any, n: int) -> str:
    """``record N`` of a file of records, or the text file an example came from."""
    return f"file {rec}" if isinstance(rec, Path) else f"record {n}"


def _count(arr: np.ndarray, eos: int, chunk: int = 1 << 24) -> int:
    return int(sum(np.count_nonzero(arr[i:i + chunk] == eos) for i in range(0, len(arr), chunk)))


def _cut_before_last_docs(arr: np.ndarray, eos: int, k: int, chunk: int = 1 << 24) -> int:
    """Position after the EOS that precedes the last ``k`` documents."""
    seen, end = 0, len(arr)
    while end > 0:
        start = max(0, end - chunk)
        hits = np.flatnonzero(arr[start:end] == eos) + start
        for h in hits[::-1]:
            if h == len(arr) - 1:
                continue
            seen += 1
            if seen == k:
                return int(h) + 1
        end = start
    raise ValueError(f"val_set_size: the token file has fewer than {k + 1} documents")
