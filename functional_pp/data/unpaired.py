"""KTO's unpaired completions from ``datasets:`` entries (``rl: kto``; docs/preference.md): each
record becomes a prompt, one completion and whether it is desirable (a ``label`` that is true or
false), tokenized as TRL's ``KTOTrainer`` does (:func:`~functional_pp.data.pairs.tokenize_completions`).

Types (Axolotl's ``prompt_strategies/kto/chatml.py``): ``chatml.argilla`` (``instruction``),
``chatml.intel`` (``question``), ``chatml.prompt_pairs`` and ``chatml.ultra`` (``prompt``),
each with ``completion`` and an optional ``system``, and ``chatml.argilla_chat`` (``completion``
a list of messages: the user's, then the reply): Axolotl's ChatML prompt, the completion ending
``<|im_end|>``. No type: the ``field_prompt``, ``field_completion`` texts as they are. The
label is ``field_label`` (default ``label``).

A batch's rows (:meth:`CompletionSet.batch_rows`): each completion after its prompt
(``tokens``, ``labels`` training the completion only), ``desirable`` (1 or 0 along the row), and
TRL's KL rows: each prompt followed by the completion of the batch's previous example
(cyclically: ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``), cut at ``sequence_len`` as TRL's
collator cuts at ``max_length`` (``kl_tokens``, ``kl_labels``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from functional_pp.data.dedup import ExactDuplicates
from functional_pp.data.formats import ByteTokenizer, _field, _records, _text_field
from functional_pp.data.pairs import _chatml_prompt, _message_content, tokenize_completions

__all__ = ["KTO_TYPES", "Completion", "CompletionSet", "completion_texts", "build_completions"]

_IM_END = "<|im_end|>"
#: Axolotl's KTO chatml.* types -> the record field holding the user's turn (None: messages)
_PROMPT_FIELD = {"chatml.argilla": "instruction", "chatml.intel": "question", "chatml.prompt_pairs": "prompt",
                 "chatml.ultra": "prompt", "chatml.argilla_chat": None}
KTO_TYPES = tuple(_PROMPT_FIELD)


@dataclass
class Completion:
    """One unpaired completion's token ids and whether it is desirable."""

    prompt: list[int]
    completion: list[int]
    desirable: bool


@dataclass
class CompletionSet:
    """The completions of a ``rl: kto`` run, each fitting ``seq_len`` tokens."""

    completions: list[Completion]
    vocab_size: int
    pad_id: int
    name: str
    dropped: int = 0                       # completions longer than seq_len, left out
    stats: list = field(default_factory=list)
    duplicates: int = 0                    # equal to an earlier one, left out (dataset_exact_deduplication)

    #: the named dimensions of a batch's tensors (the training step's ``batch_dims``)
    batch_dims = {k: "batch seq" for k in ("tokens", "labels", "kl_tokens", "kl_labels", "desirable")}
    unit = "completions (KTO)"

    def sequences(self) -> list[list[int]]:
        """Every completion's prompt and completion ids and its label, in order (what the resume
        digest hashes)."""
        return [s for c in self.completions for s in (c.prompt, c.completion, [int(c.desirable)])]

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def desirable(self) -> int:
        return sum(c.desirable for c in self.completions)

    def batch_rows(self, indices: Any, seq_len: int) -> dict[str, np.ndarray]:
        """The rows of completions ``indices`` (in this order) and their KL rows (see the module
        docstring)."""
        chosen = [self.completions[j] for j in indices]
        n = len(chosen)
        out = {k: np.full((n, seq_len), self.pad_id if k.endswith("tokens") else -100, dtype=np.int64)
               for k in ("tokens", "labels", "kl_tokens", "kl_labels")}
        out["desirable"] = np.zeros((n, seq_len), dtype=np.float32)
        for i, c in enumerate(chosen):
            _fill(out["tokens"][i], out["labels"][i], c.prompt, c.completion)
            _fill(out["kl_tokens"][i], out["kl_labels"][i], c.prompt, chosen[i - 1].completion)
            out["desirable"][i] = float(c.desirable)
        return out


def _fill(ids: np.ndarray, labels: np.ndarray, prompt: list[int], completion: list[int]) -> None:
    """One row: prompt + completion (cut at the row's length), the label of position t the
    next token where that is a completion token."""
    full = (prompt + completion)[:len(ids)]
    ids[:len(full)] = full
    labels[len(prompt) - 1:len(full) - 1] = full[len(prompt):]


def completion_texts(rec: Any, entry: Any, where: str, n: int) -> tuple[str, str, bool]:
    """``(prompt, completion, desirable)`` of record ``n`` of a ``datasets`` entry."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: record {n} is a {type(rec).__name__}, not a mapping of fields")
    kind = entry.type
    label_key = getattr(entry, "field_label", None) or "label"
    label = _field(rec, label_key, where, n)
    if not isinstance(label, bool):
        raise ValueError(f"{where}: record {n}: field {label_key!r} is {label!r} ({type(label).__name__}), not "
                         f"true or false; KTO's label says whether the completion is desirable: give a boolean")
    if kind is None:
        return (_text_field(rec, entry.field_prompt, where, n),
                _text_field(rec, getattr(entry, "field_completion", None) or "completion", where, n), label)
    if kind not in _PROMPT_FIELD:
        raise ValueError(f"{where.split(':')[0]}.type {kind!r} is not a KTO dataset type; choose one of "
                         f"{', '.join(KTO_TYPES)}, or leave type out for plain prompt / completion / label fields")
    if kind == "chatml.argilla_chat":
        return (_chatml_prompt(None, _message_content(rec, "completion", 0, where, n)),
                _message_content(rec, "completion", 1, where, n) + _IM_END, label)
    system = rec.get("system")
    prompt = _chatml_prompt(system if isinstance(system, str) and system else None,
                            _text_field(rec, _PROMPT_FIELD[kind], where, n))
    return prompt, _text_field(rec, "completion", where, n) + _IM_END, label


def build_completions(entries: list, tokenizer: Any, *, seq_len: int, deduplicate: bool = False) -> CompletionSet:
    """The unpaired completions of ``datasets:`` entries (DatasetConfig), tokenized; one whose
    prompt and completion exceed ``seq_len`` tokens is left out and counted; none left is an
    error naming the shortest length found. ``deduplicate``: one equal to an earlier one (the same
    tokens and label) is left out and counted."""
    tok = tokenizer or ByteTokenizer()
    kept, dropped, shortest = [], 0, None
    repeats = ExactDuplicates(deduplicate)
    for i, entry in enumerate(entries):
        where = f"datasets[{i}]: {entry.path}"
        if not Path(entry.path).exists():
            raise FileNotFoundError(f"{where}: no such file or directory")
        for n, rec in enumerate(_records(Path(entry.path), entry.ds_type, entry.split, where), start=1):
            prompt, completion, label = completion_texts(rec, entry, where, n)
            if not completion:
                raise ValueError(f"{where}: record {n}: the completion is empty")
            p, (c,) = tokenize_completions(tok, prompt, [completion])
            if not p:
                raise ValueError(f"{where}: record {n}: the prompt is empty (no token before the completion); "
                                 f"give every completion a prompt")
            if len(p) + len(c) > seq_len:
                dropped += 1
                shortest = len(p) + len(c) if shortest is None else min(shortest, len(p) + len(c))
                continue
            if repeats.is_repeat(p, c, label):
                continue
            kept.append(Completion(p, c, label))
    names = ", ".join(Path(e.path).name for e in entries)
    if not kept:
        raise ValueError(f"no completion of {names} fits sequence_len {seq_len} "
                         + (f"(the shortest needs {shortest} tokens): raise sequence_len" if dropped
                            else "(the datasets hold no record)"))
    pad = tok.eos_id if tok.eos_id is not None else 0
    return CompletionSet(kept, int(tok.vocab_size), int(pad), names, dropped, duplicates=repeats.count)
