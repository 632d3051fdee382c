"""The documents of an ``rl: ebft`` run (docs/preference.md "EBFT"), from Axolotl's two strided
dataset types, each record one row of ``sequence_len`` tokens:

- ``ebft_pretrain.transform`` (Axolotl's example): the text of ``question`` (else ``text``),
  tokenized with the tokenizer's special tokens, cut at and padded to ``sequence_len`` with the
  pad token; every token of the row is a label (its padding too);
- ``ebft_strided_structured.transform``: the prompt (``input``, else ``prompt`` / ``question``)
  tokenized with the special tokens, then the completion (``output``, else ``completion`` /
  ``answer``) without; cut to ``sequence_len`` (the completion first, keeping one token), padded;
  labels on the completion only, and the prompt's length (the anchors start after it)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from functional_pp.data.formats import _records, _text_field

__all__ = ["EBFT_TYPES", "Document", "DocumentSet", "build_documents"]

PRETRAIN, STRUCTURED = "ebft_pretrain.transform", "ebft_strided_structured.transform"
#: the ``datasets[].type`` values of ``rl: ebft``
EBFT_TYPES = (PRETRAIN, STRUCTURED)
_FIELDS = {PRETRAIN: (("question", "text"),),
           STRUCTURED: (("input", "prompt", "question"), ("output", "completion", "answer"))}


@dataclass(frozen=True)
class Document:
    """One training document: ``tokens`` (``sequence_len`` ids, padded as its dataset type pads),
    ``labels`` (the tokens the cross-entropy trains, -100 elsewhere) and ``prompt_length`` (None:
    no prompt; the anchors start after it)."""

    tokens: tuple[int, ...]
    labels: tuple[int, ...]
    prompt_length: int | None = None


@dataclass
class DocumentSet:
    """A run's documents (:class:`Document`); ``prompts``
    is what the step loader (:class:`~functional_pp.data.prompts.PromptLoader`) draws from."""

    prompts: list
    vocab_size: int
    pad_id: int
    name: str
    dropped: int = 0
    duplicates: int = 0
    unit = "documents"
    #: the named dimensions of an EBFT batch's tensors (the training step's ``batch_dims``)
    batch_dims = {k: "batch seq" for k in ("tokens", "labels", "weights", "step_tokens", "segments", "position_ids",
                                           "prefix")}

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def stats(self) -> list:
        return []

    @property
    def tokens(self) -> np.ndarray:
        """Every document's tokens, one after another (what the ranks of a run compare)."""
        return np.concatenate([np.asarray(d.tokens, dtype=np.int64) for d in self.prompts])


def _first_text(rec: Any, keys: tuple[str, ...], where: str, n: int) -> str:
    for key in keys:
        if isinstance(rec, dict) and key in rec:
            return _text_field(rec, key, where, n)
    have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
    raise ValueError(f"{where}: record {n} has none of the fields {', '.join(keys)} (it has {have})")


def _transformers_ids(tok: Any, text: str) -> list[int]:
    """``text``'s ids with the tokenizer's special tokens, as transformers' ``tokenizer(text)``."""
    if hasattr(tok, "encode_as_transformers"):
        return list(tok.encode_as_transformers(text))
    ids = list(tok.encode(text))
    return [tok.bos_id, *ids] if getattr(tok, "add_bos", False) and tok.bos_id is not None else ids


def document(kind: str, rec: Any, tok: Any, seq_len: int, pad_id: int, where: str, n: int):
    """The :class:`Document` of one record."""
    if kind == PRETRAIN:
        ids = _transformers_ids(tok, _first_text(rec, _FIELDS[PRETRAIN][0], where, n))[:seq_len]
        ids = ids + [pad_id] * (seq_len - len(ids))
        return Document(tuple(ids), tuple(ids))
    prompt = _transformers_ids(tok, _first_text(rec, _FIELDS[STRUCTURED][0], where, n))
    completion = list(tok.encode(_first_text(rec, _FIELDS[STRUCTURED][1], where, n)))
    if len(prompt) + len(completion) > seq_len:
        if seq_len - len(prompt) < 1:
            prompt, completion = prompt[:seq_len - 1], completion[:1]
        else:
            completion = completion[:seq_len - len(prompt)]
    pad = seq_len - len(prompt) - len(completion)
    return Document(tuple(prompt + completion + [pad_id] * pad),
                    tuple([-100] * len(prompt) + completion + [-100] * pad), prompt_length=len(prompt))


def build_documents(entries: list, tokenizer: Any, *, seq_len: int, pad_id: int) -> DocumentSet:
    """The documents of ``datasets:`` entries (each ``type`` one of :data:`EBFT_TYPES`)."""
    docs = []
    for i, entry in enumerate(entries):
        where = f"datasets[{i}]: {entry.path}"
        if entry.type not in EBFT_TYPES:
            raise ValueError(f"{where}: type {entry.type!r} is not an EBFT dataset type; choose one of "
                             f"{', '.join(EBFT_TYPES)}")
        if not Path(entry.path).exists():
            raise FileNotFoundError(f"{where}: no such file or directory")
        for n, rec in enumerate(_records(Path(entry.path), entry.ds_type, entry.split, where), start=1):
            docs.append(document(entry.type, rec, tokenizer, seq_len, pad_id, where, n))
    if not docs:
        raise ValueError(f"no document in {', '.join(Path(e.path).name for e in entries)} (the datasets hold no "
                         f"record)")
    return DocumentSet(docs, int(tokenizer.vocab_size), int(pad_id), ", ".join(Path(e.path).name for e in entries))
