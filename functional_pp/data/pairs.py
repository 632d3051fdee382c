"""Preference pairs from ``datasets:`` entries (Axolotl's ``rl:`` dataset types): each record
becomes a prompt and a chosen and a rejected completion, tokenized as TRL's ``DPOTrainer``
does (the prompt, then the completion with EOS appended), each side one row of
``sequence_len`` tokens whose labels train only the completion (docs/preference.md).

Types (Axolotl's ``prompt_strategies/dpo/chatml.py`` and ``llama3.py``), for ``F`` each of
``chatml`` and ``llama3``: ``F.intel`` (``question``), ``F.argilla`` and ``F.default``
(``prompt`` / ``input`` / ``question`` / ``instruction``; ``chosen`` or ``chosen_response``),
``F.icr`` (``input``), ``F.prompt_pairs`` (``prompt``), ``F.ultra`` and ``F.argilla_chat``
(chosen / rejected as message lists): the family's prompt -- ChatML's ``<|im_start|>user ...
<|im_start|>assistant``, Llama 3's ``<|start_header_id|>user<|end_header_id|> ...
<|start_header_id|>assistant<|end_header_id|>`` -- (an optional ``system`` first), completions
ending ``<|im_end|>`` / ``<|eot_id|>``; ``chat_template.default`` and
``chat_template.argilla_chat``: conversations rendered with the run's chat template
(:mod:`functional_pp.data.chat_pairs`); a mapping (Axolotl's user-defined type,
``user_defined.default``): ``field_prompt`` / ``field_system`` / ``field_chosen`` /
``field_rejected`` written through ``prompt_format`` / ``chosen_format`` / ``rejected_format``.
No type: the ``field_prompt``, ``field_chosen``, ``field_rejected`` texts as they are."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from functional_pp.data.chat_pairs import CHAT_PAIR_TYPES, ChatPairReader
from functional_pp.data.dedup import ExactDuplicates
from functional_pp.data.formats import ByteTokenizer, _records, _text_field, _with_bos, chat_spec

__all__ = ["PAIR_TYPES", "USER_DEFINED_KEYS", "user_defined_problem", "Pair", "PairSet", "pair_texts", "tokenize_pair", "build_pairs"]

_IM_END = "<|im_end|>"
_EOT = "<|eot_id|>"
_ANY_PROMPT = ("prompt", "input", "question", "instruction")
#: Axolotl's chatml.* / llama3.* preference strategies -> the record fields holding the prompt
#: (first found; None: the user turn of the chosen conversation)
_STRATEGY_PROMPT = {"intel": ("question",), "icr": ("input",), "prompt_pairs": ("prompt",), "ultra": ("prompt",),
                    "argilla": _ANY_PROMPT, "default": _ANY_PROMPT, "argilla_chat": None}
_FAMILIES = ("chatml", "llama3")
_TEMPLATE_TYPES = tuple(f"{f}.{s}" for f in _FAMILIES for s in _STRATEGY_PROMPT)
#: Axolotl's user-defined preference type (``type:`` a mapping): its keys -> their defaults
USER_DEFINED_KEYS = {"field_prompt": "prompt", "field_system": "system", "field_chosen": "chosen",
                     "field_rejected": "rejected", "prompt_format": "{prompt}", "chosen_format": "{chosen}",
                     "rejected_format": "{rejected}"}
_FORMAT_NAMES = {"prompt_format": ("prompt", "system"), "chosen_format": ("chosen",),
                 "rejected_format": ("rejected",)}
PAIR_TYPES = (*_TEMPLATE_TYPES, *CHAT_PAIR_TYPES)


@dataclass
class Pair:
    """One preference pair's token ids: the prompt, the chosen and the rejected completion."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass
class PairSet:
    """The pairs of a run, each side of each pair fitting ``seq_len`` tokens."""

    pairs: list[Pair]
    vocab_size: int
    pad_id: int
    name: str
    dropped: int = 0                       # pairs longer than seq_len, left out
    stats: list = field(default_factory=list)
    duplicates: int = 0                    # pairs equal to an earlier one, left out (dataset_exact_deduplication)
    ref_logps: np.ndarray | None = None    # [pairs, 2]: the reference's chosen / rejected log-probs, if precomputed
    with_index: bool = False               # batches carry each row's pair index (``pair_index``)

    #: the named dimensions of a batch's tensors (the training step's ``batch_dims``)
    batch_dims = {k: "batch seq" for k in ("chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels",
                                           "chosen_lm_labels", "pair_weight", "ref_chosen_logps",
                                           "ref_rejected_logps", "pair_index")}
    unit = "preference pairs"

    def __len__(self) -> int:
        return len(self.pairs)

    def sequences(self) -> list[list[int]]:
        """Every pair's prompt, chosen and rejected ids, in order (what the resume digest hashes)."""
        return [s for p in self.pairs for s in (p.prompt, p.chosen, p.rejected)]

    def batch_rows(self, indices: Any, seq_len: int, weights: Any = None) -> dict[str, np.ndarray]:
        """The rows of pairs ``indices`` (:func:`pair_rows`), stacked, and ``pair_weight`` (each
        pair's weight along its row: 1, or ``weights``; a pair of weight 0 trains no label)."""
        rows = [pair_rows(self.pairs[j], seq_len, self.pad_id) for j in indices]
        out = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        w = np.ones(len(rows), dtype=np.float32) if weights is None else np.asarray(weights, dtype=np.float32)
        for k in ("chosen_labels", "rejected_labels", "chosen_lm_labels"):
            out[k][w == 0] = -100
        out["pair_weight"] = np.repeat(w[:, None], seq_len, axis=1)
        indices = np.asarray(indices)
        if self.ref_logps is not None:       # precomputed: each row its pair's value along the row
            for i, side in enumerate(("chosen", "rejected")):
                out[f"ref_{side}_logps"] = np.repeat(self.ref_logps[indices, i][:, None], seq_len, axis=1)
        if self.with_index:
            out["pair_index"] = np.repeat(indices.astype(np.float64)[:, None], seq_len, axis=1)
        return out

    def split(self, n_val: int, seed: int) -> tuple["PairSet", "PairSet"]:
        """``(train, held out)``: ``n_val`` pairs chosen by the seed held out (as
        ``val_set_size`` holds out examples of language-model data)."""
        held = set(np.random.default_rng([seed, 7]).permutation(len(self.pairs))[len(self.pairs) - n_val:].tolist())
        train = [x for i, x in enumerate(self.pairs) if i not in held]
        val = [x for i, x in enumerate(self.pairs) if i in held]
        return (PairSet(train, self.vocab_size, self.pad_id, self.name, self.dropped, self.stats, self.duplicates),
                PairSet(val, self.vocab_size, self.pad_id, f"{self.name}[val]"))


def _chatml_prompt(system: str | None, user: str) -> str:
    head = f"<|im_start|>system\n{system}{_IM_END}\n" if system else ""
    return f"{head}<|im_start|>user\n{user}{_IM_END}\n<|im_start|>assistant\n"


def _llama3_prompt(system: str | None, user: str) -> str:
    def turn(role: str, text: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}{_EOT}"
    head = turn("system", system) if system else ""
    return f"{head}{turn('user', user)}<|start_header_id|>assistant<|end_header_id|>\n\n"


#: a family -> (its prompt of (system, user), the text ending each completion)
_FAMILY_FORMAT = {"chatml": (_chatml_prompt, _IM_END), "llama3": (_llama3_prompt, _EOT)}


def user_defined_problem(spec: Any) -> str | None:
    """Why ``spec`` (a ``type:`` mapping, Axolotl's ``user_defined.default``) cannot be read, or
    None: an unknown key, a value that is not text, a format naming a field it cannot fill."""
    import string
    for key, value in spec.items():
        if key not in USER_DEFINED_KEYS:
            return (f"key {key!r} is not one of Axolotl's user-defined preference type "
                    f"({', '.join(USER_DEFINED_KEYS)})")
        if value is not None and not isinstance(value, str):
            return f"{key} must be text, got {value!r}"
    for key, names in _FORMAT_NAMES.items():
        text = spec.get(key)
        if not text:
            continue
        try:
            used = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
        except ValueError as exc:
            return f"{key} {text!r} is not a format string: {exc}"
        bad = [f for f in used if f not in names]
        if bad:
            return (f"{key} {text!r} names {{{bad[0]}}}; it may name only "
                    f"{' and '.join('{' + n + '}' for n in names)}")
        if key == "prompt_format" and "prompt" not in used:
            return f"prompt_format {text!r} does not name {{prompt}}: the prompt would leave out the record's prompt"
    return None


def _user_defined_texts(rec: dict, spec: dict, where: str, n: int) -> tuple[str, str, str]:
    """Axolotl's ``dpo/user_defined.default``: each format filled with the record's fields
    (``{system}`` with ``field_system``'s text, or nothing where the record has none)."""
    get = {k: spec.get(k) or d for k, d in USER_DEFINED_KEYS.items()}
    prompt = _text_field(rec, get["field_prompt"], where, n)
    if "{system}" in get["prompt_format"]:
        system = rec.get(get["field_system"]) or ""
        if not isinstance(system, str):
            raise ValueError(f"{where}: record {n}: field {get['field_system']!r} is a "
                             f"{type(system).__name__}, not text")
        prompt = get["prompt_format"].format(system=system, prompt=prompt)
    else:
        prompt = get["prompt_format"].format(prompt=prompt)
    return (prompt, get["chosen_format"].format(chosen=_text_field(rec, get["field_chosen"], where, n)),
            get["rejected_format"].format(rejected=_text_field(rec, get["field_rejected"], where, n)))


def _message_content(rec: dict, key: str, index: int, where: str, n: int) -> str:
    """``rec[key][index]["content"]`` (a list of messages), refused naming the record otherwise."""
    turns = rec.get(key)
    if not isinstance(turns, list) or len(turns) <= index or not isinstance(turns[index], dict) \
            or not isinstance(turns[index].get("content"), str):
        raise ValueError(f"{where}: record {n}: field {key!r} must be a list of messages with a text 'content' "
                         f"at position {index} (user, then assistant), got {str(turns)[:80]!r}")
    return turns[index]["content"]


def pair_texts(rec: Any, entry: Any, where: str, n: int) -> tuple[str, str, str]:
    """``(prompt, chosen, rejected)`` texts of record ``n`` of a ``datasets`` entry."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: record {n} is a {type(rec).__name__}, not a mapping of fields")
    kind = entry.type
    if kind is None:
        return tuple(_text_field(rec, k, where, n) for k in (entry.field_prompt, entry.field_chosen,
                                                              entry.field_rejected))
    if isinstance(kind, dict):
        problem = user_defined_problem(kind)
        if problem:
            raise ValueError(f"{where.split(':')[0]}.type (user-defined): {problem}")
        return _user_defined_texts(rec, kind, where, n)
    if kind in CHAT_PAIR_TYPES:
        raise ValueError(f"{where}: type {kind!r} renders conversations with a chat template: read it with "
                         f"ChatPairReader (build_pairs does)")
    if kind not in PAIR_TYPES:
        raise ValueError(f"{where.split(':')[0]}.type {kind!r} is not a preference dataset type; choose one of "
                         f"{', '.join(PAIR_TYPES)}, a mapping (Axolotl's user-defined type: "
                         f"{', '.join(USER_DEFINED_KEYS)}), or leave type out for plain prompt / chosen / "
                         f"rejected fields")
    family, strategy = kind.split(".", 1)
    write_prompt, end = _FAMILY_FORMAT[family]
    system = rec.get("system") or None
    if strategy == "argilla_chat":
        user = _message_content(rec, "chosen", 0, where, n)
        return (write_prompt(None, user), _message_content(rec, "chosen", 1, where, n) + end,
                _message_content(rec, "rejected", 1, where, n) + end)
    keys = _STRATEGY_PROMPT[strategy]
    key = next((k for k in keys if k in rec), keys[-1])
    prompt = write_prompt(system if isinstance(system, str) else None, _text_field(rec, key, where, n))
    if strategy == "ultra":
        return (prompt, _message_content(rec, "chosen", 1, where, n) + end,
                _message_content(rec, "rejected", 1, where, n) + end)
    either = strategy in ("argilla", "default")
    chosen = "chosen" if not either or "chosen" in rec else "chosen_response"
    rejected = "rejected" if not either or "rejected" in rec else "rejected_response"
    return prompt, _text_field(rec, chosen, where, n) + end, _text_field(rec, rejected, where, n) + end


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def tokenize_completions(tok: Any, prompt: str, completions: list[str]) -> tuple[list[int], list[list[int]]]:
    """TRL 1.16's tokenization (``DPOTrainer`` / ``KTOTrainer._prepare_dataset``) as Axolotl
    runs it: the tokenizer's EOS text appended to each completion that does not end with it;
    the prompt and each prompt + completion tokenized whole (with BOS where the tokenizer adds
    one, a doubled BOS made one as Axolotl's trainer does); the completions start where the
    prompt's tokens and every sequence's stop agreeing. Returns ``(prompt ids, completion ids)``."""
    eos_text = (getattr(tok, "special_tokens", None) or {}).get("eos_token")
    if eos_text:
        completions = [c if c.endswith(eos_text) else c + eos_text for c in completions]

    def ids_of(text: str) -> list[int]:
        ids = _with_bos(tok, tok.encode(text), None)[0]
        return ids[1:] if tok.bos_id is not None and ids[:2] == [tok.bos_id] * 2 else ids

    p = ids_of(prompt)
    whole = [ids_of(prompt + c) for c in completions]
    n = min(_common_prefix(p, w) for w in whole)
    out = [w[n:] for w in whole]
    if not eos_text and tok.eos_id is not None:          # a tokenizer without an EOS text: its id
        out = [c if c[-1:] == [tok.eos_id] else [*c, tok.eos_id] for c in out]
    return p[:n], out


def tokenize_pair(tok: Any, prompt: str, chosen: str, rejected: str) -> Pair:
    """A pair tokenized as :func:`tokenize_completions` (TRL's ``DPOTrainer``)."""
    p, (c, r) = tokenize_completions(tok, prompt, [chosen, rejected])
    return Pair(p, c, r)


def _readers(entries: list, tok: Any, chat_template: str | None, chat_template_jinja: str | None) -> list:
    """Per entry: the :class:`ChatPairReader` of a ``chat_template.*`` type, else None."""
    out = []
    for i, entry in enumerate(entries):
        if entry.type not in CHAT_PAIR_TYPES:
            out.append(None)
            continue
        spec = chat_spec(entry, tok, train_inputs=False, default_template=chat_template,
                         default_jinja=chat_template_jinja, where=f"datasets[{i}]")
        try:
            out.append(ChatPairReader.for_entry(entry, spec.template, spec.special_tokens))
        except ValueError as exc:
            raise ValueError(f"datasets[{i}]: {exc}") from exc
    return out


def _entry_pairs(entry: Any, tok: Any, where: str, reader: ChatPairReader | None) -> Iterator[tuple[int, Pair]]:
    for n, rec in enumerate(_records(Path(entry.path), entry.ds_type, entry.split, where), start=1):
        if reader is None:
            prompt, chosen, rejected = pair_texts(rec, entry, where, n)
        else:
            try:
                prompt, chosen, rejected = reader.texts(rec)
            except ValueError as exc:
                raise ValueError(f"{where}: record {n}: {exc}") from exc
        if not chosen or not rejected:
            side = "chosen" if not chosen else "rejected"
            raise ValueError(f"{where}: record {n}: the {side} completion is empty; every pair needs two completions")
        pair = tokenize_pair(tok, prompt, chosen, rejected)
        if not pair.prompt:
            raise ValueError(f"{where}: record {n}: the prompt is empty (no token before the completions); "
                             f"give every pair a prompt")
        yield n, pair


def build_pairs(entries: list, tokenizer: Any, *, seq_len: int, chat_template: str | None = None,
                chat_template_jinja: str | None = None, deduplicate: bool = False) -> PairSet:
    """The preference pairs of ``datasets:`` entries (DatasetConfig), tokenized; a pair whose
    prompt and longer completion exceed ``seq_len`` tokens is left out and counted (Axolotl
    drops them too); no pair left is an error naming the shortest length found.
    ``chat_template`` / ``chat_template_jinja``: the run's template for ``chat_template.*``
    entries that name none (none at all: the tokenizer's, else ChatML). ``deduplicate`` (Axolotl's
    ``dataset_exact_deduplication``): a pair equal to an earlier one (the same tokens) is left out
    and counted."""
    tok = tokenizer or ByteTokenizer()
    pairs, dropped, shortest = [], 0, None
    repeats = ExactDuplicates(deduplicate)
    readers = _readers(entries, tok, chat_template, chat_template_jinja)
    for i, entry in enumerate(entries):
        where = f"datasets[{i}]: {entry.path}"
        if not Path(entry.path).exists():
            raise FileNotFoundError(f"{where}: no such file or directory")
        for _, pair in _entry_pairs(entry, tok, where, readers[i]):
            if repeats.is_repeat(pair.prompt, pair.chosen, pair.rejected):
                continue
            need = len(pair.prompt) + max(len(pair.chosen), len(pair.rejected))
            if need > seq_len:
                dropped += 1
                shortest = need if shortest is None else min(shortest, need)
                continue
            pairs.append(pair)
    names = ", ".join(Path(e.path).name for e in entries)
    if not pairs:
        raise ValueError(f"no preference pair of {names} fits sequence_len {seq_len} "
                         + (f"(the shortest needs {shortest} tokens): raise sequence_len" if dropped
                            else "(the datasets hold no record)"))
    pad = tok.eos_id if tok.eos_id is not None else 0
    return PairSet(pairs, int(tok.vocab_size), int(pad), names, dropped, duplicates=repeats.count)


def pair_rows(pair: Pair, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One pair as rows of ``seq_len``: ``chosen_tokens`` / ``rejected_tokens`` (prompt +
    completion, then ``pad_id``), ``chosen_labels`` / ``rejected_labels`` (the next token
    where it is a completion token, else -100) and ``chosen_lm_labels`` (the next token
    wherever there is one: ORPO's NLL over the whole chosen sequence)."""
    out = {}
    for side, completion in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        ids = np.full(seq_len, pad_id, dtype=np.int64)
        full = pair.prompt + completion
        ids[:len(full)] = full
        labels = np.full(seq_len, -100, dtype=np.int64)
        labels[len(pair.prompt) - 1:len(full) - 1] = completion
        out[f"{side}_tokens"], out[f"{side}_labels"] = ids, labels
        if side == "chosen":
            lm = np.full(seq_len, -100, dtype=np.int64)
            lm[:len(full) - 1] = full[1:]
            out["chosen_lm_labels"] = lm
    return out
