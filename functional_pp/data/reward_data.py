"""Reward-model data (docs/reward_models.md): Axolotl's ``bradley_terry.chat_template`` pairs
for ``reward_model: true`` and its ``stepwise_supervised`` rows for ``process_reward_model: true``.

- ``bradley_terry.chat_template`` (Axolotl's ``prompt_strategies/bradley_terry/chat_template.py``):
  a record's ``system`` (optional), ``input``, ``chosen`` and ``rejected`` texts become two
  conversations, ``[system, user input, assistant chosen]`` and the same with ``rejected``, each
  tokenized whole with the run's chat template and cut to ``sequence_len`` (as Axolotl). An
  optional ``margin`` field is TRL ``RewardTrainer``'s margin. A row is padded with the pad id
  (the tokenizer's pad token, else its EOS: TRL's choice) and its score is read at the last
  token that is not the pad id (``chosen_last`` / ``rejected_last``: transformers' rule).
- ``stepwise_supervised`` (TRL's ``PRMTrainer.tokenize_row`` as Axolotl runs it): ``prompt``,
  ``completions`` (the steps) and ``labels`` (one per step); each step is followed by the
  tokens of ``step_separator`` whose last one carries the step's label (every other token -100),
  BOS first where the tokenizer has one, the completion cut to ``max_completion_length`` and the
  row to ``sequence_len``; ``train_on_last_step_only`` labels the last step alone (training
  rows; held-out rows keep every label, as TRL's ``is_eval``)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from functional_pp.data.chat import tokenize_chat
from functional_pp.data.formats import ByteTokenizer, _records, chat_spec

__all__ = ["BRADLEY_TERRY_TYPES", "STEPWISE_TYPES", "ScoredPair", "ScoredPairSet", "StepwiseSet",
           "last_token_mask", "pad_id_of", "build_scored_pairs", "build_stepwise", "stepwise_row"]

BRADLEY_TERRY_TYPES = ("bradley_terry.chat_template",)
STEPWISE_TYPES = ("stepwise_supervised",)
IGNORE = -100


def pad_id_of(tok: Any) -> int:
    """The id rows are padded with: the tokenizer's pad token, else its EOS (TRL's
    ``RewardTrainer``), else 0."""
    text = (getattr(tok, "special_tokens", None) or {}).get("pad_token")
    i = tok.token_to_id(text) if text and hasattr(tok, "token_to_id") else None
    if i is None:
        i = tok.eos_id
    return int(i) if i is not None else 0


def last_token_mask(tokens: np.ndarray, pad_id: int | None) -> np.ndarray:
    """``[..., seq]`` float32 one-hot of each row's rightmost token that is not ``pad_id``
    (transformers' ``*ForSequenceClassification``; position 0 for a row of pads only)."""
    n = tokens.shape[-1]
    idx = (np.arange(n) * (tokens != pad_id)).argmax(-1) if pad_id is not None else np.full(tokens.shape[:-1], n - 1)
    return np.eye(n, dtype=np.float32)[idx]


@dataclass
class ScoredPair:
    """One Bradley-Terry pair: the chosen and the rejected conversation's ids, and its margin."""

    chosen: list[int]
    rejected: list[int]
    margin: float = 0.0


def _padded(ids: list[int], seq_len: int, pad_id: int) -> np.ndarray:
    row = np.full(seq_len, pad_id, dtype=np.int64)
    row[:len(ids)] = ids[:seq_len]
    return row


@dataclass
class ScoredPairSet:
    """The pairs of a reward-model run (each side at most ``seq_len`` tokens)."""

    pairs: list[ScoredPair]
    vocab_size: int
    pad_id: int
    name: str
    truncated: int = 0                     # sides cut to seq_len (Axolotl warns and cuts)
    has_margin: bool = False
    stats: list = field(default_factory=list)

    batch_dims = {k: "batch seq" for k in ("chosen_tokens", "rejected_tokens", "chosen_last", "rejected_last",
                                           "margin", "pair_weight")}
    unit = "preference pairs"

    def __len__(self) -> int:
        return len(self.pairs)

    def sequences(self) -> list[list[int]]:
        """Every pair's chosen and rejected ids (and its margin, as an id list), in order (what
        the resume digest hashes)."""
        return [s for p in self.pairs for s in (p.chosen, p.rejected, [int(p.margin * 1e6)])]

    def batch_rows(self, indices: Any, seq_len: int, weights: Any = None) -> dict[str, np.ndarray]:
        """The rows of pairs ``indices``: tokens padded with ``pad_id``, the one-hot of each
        row's scored token, ``margin`` (along the row; TRL's margin column) and ``pair_weight``
        (1, or ``weights``: an evaluation's wrapped pairs weigh 0)."""
        out: dict[str, np.ndarray] = {}
        for side in ("chosen", "rejected"):
            toks = np.stack([_padded(getattr(self.pairs[j], side), seq_len, self.pad_id) for j in indices])
            out[f"{side}_tokens"] = toks
            out[f"{side}_last"] = last_token_mask(toks, self.pad_id)
        margin = np.array([self.pairs[j].margin for j in indices], dtype=np.float32)
        out["margin"] = np.repeat(margin[:, None], seq_len, axis=1)
        w = np.ones(len(indices), dtype=np.float32) if weights is None else np.asarray(weights, dtype=np.float32)
        out["pair_weight"] = np.repeat(w[:, None], seq_len, axis=1)
        return out

    def split(self, n_val: int, seed: int) -> tuple["ScoredPairSet", "ScoredPairSet"]:
        """``(train, held out)``: ``n_val`` pairs chosen by the seed held out."""
        held = set(np.random.default_rng([seed, 7]).permutation(len(self.pairs))[len(self.pairs) - n_val:].tolist())
        return (replace(self, pairs=[x for i, x in enumerate(self.pairs) if i not in held]),
                replace(self, pairs=[x for i, x in enumerate(self.pairs) if i in held], name=f"{self.name}[val]"))


def _text(rec: Any, key: str, where: str, n: int, optional: bool = False) -> str | None:
    value = rec.get(key) if isinstance(rec, dict) else None
    if value is None and optional:
        return None
    if not isinstance(value, str):
        have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise ValueError(f"{where}: record {n}: bradley_terry.chat_template needs a text field {key!r} "
                         f"(Axolotl's fields: system (optional), input, chosen, rejected); the record has {have}")
    return value


def build_scored_pairs(entries: list, tokenizer: Any, *, seq_len: int, chat_template: str | None = None,
                       chat_template_jinja: str | None = None) -> ScoredPairSet:
    """The Bradley-Terry pairs of ``datasets:`` entries of type ``bradley_terry.chat_template``."""
    tok = tokenizer or ByteTokenizer()
    pairs, truncated, has_margin = [], 0, False
    for i, entry in enumerate(entries):
        where = f"datasets[{i}]: {entry.path}"
        if entry.type not in BRADLEY_TERRY_TYPES:
            raise ValueError(f"datasets[{i}]: type {entry.type!r}: reward_model reads "
                             f"{', '.join(BRADLEY_TERRY_TYPES)} pairs")
        if not Path(entry.path).exists():
            raise FileNotFoundError(f"{where}: no such file or directory")
        spec = chat_spec(entry, tok, train_inputs=False, default_template=chat_template,
                         default_jinja=chat_template_jinja, where=f"datasets[{i}]")
        for n, rec in enumerate(_records(Path(entry.path), entry.ds_type, entry.split, where), start=1):
            system = _text(rec, "system", where, n, optional=True)
            user = _text(rec, "input", where, n)
            sides = []
            for key in ("chosen", "rejected"):
                turns = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": user}, {"role": "assistant", "content": _text(rec, key, where, n)}]
                ids, _ = tokenize_chat(tok, {"messages": turns}, spec)
                truncated += len(ids) > seq_len
                sides.append(ids[:seq_len])
            margin = rec.get("margin") if isinstance(rec, dict) else None
            if margin is not None and not isinstance(margin, (int, float)):
                raise ValueError(f"{where}: record {n}: margin must be a number, got {margin!r}")
            has_margin |= margin is not None
            pairs.append(ScoredPair(*sides, float(margin or 0.0)))
    if not pairs:
        raise ValueError(f"the datasets {', '.join(Path(e.path).name for e in entries)} hold no record")
    return ScoredPairSet(pairs, int(tok.vocab_size), pad_id_of(tok), ", ".join(Path(e.path).name for e in entries),
                         truncated, has_margin)


# ----------------------------------------------------------------------------- stepwise_supervised
@dataclass
class StepwiseRow:
    """One stepwise-supervised example: its ids and labels (-100 but at each step's separator)."""

    tokens: list[int]
    labels: list[int]


def stepwise_row(tok: Any, rec: Any, *, step_separator: str, seq_len: int, max_completion_length: int | None,
                 train_on_last_step_only: bool, is_eval: bool, where: str = "", n: int = 0) -> StepwiseRow:
    """TRL ``PRMTrainer.tokenize_row`` (Axolotl's ``stepwise_supervised``) of one record."""
    if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
        raise ValueError(f"{where}: record {n}: stepwise_supervised needs a text field 'prompt'")
    steps, labels = rec.get("completions"), rec.get("labels")
    if (not isinstance(steps, list) or not all(isinstance(s, str) for s in steps) or not isinstance(labels, list)
            or len(labels) != len(steps) or not steps):
        raise ValueError(f"{where}: record {n}: stepwise_supervised needs 'completions' (a list of step texts) and "
                         f"'labels' (one per step); got {len(steps) if isinstance(steps, list) else steps!r} "
                         f"steps and {len(labels) if isinstance(labels, list) else labels!r} labels")
    prompt = tok.encode(rec["prompt"])
    steps_ids = [tok.encode(s) for s in steps]
    if train_on_last_step_only and not is_eval:
        labels = [IGNORE] * (len(labels) - 1) + [int(labels[-1])]
    else:
        labels = [int(x) for x in labels]
    sep = tok.encode(step_separator)
    steps_ids = [s + sep for s in steps_ids]
    step_labels = [[IGNORE] * (len(s) - 1) + [lab] for s, lab in zip(steps_ids, labels)]
    completion, comp_labels = list(chain(*steps_ids)), list(chain(*step_labels))
    if max_completion_length:
        completion, comp_labels = completion[:max_completion_length], comp_labels[:max_completion_length]
    if tok.bos_id is not None:
        prompt = [tok.bos_id] + prompt
    ids, out = prompt + completion, [IGNORE] * len(prompt) + comp_labels
    return StepwiseRow(ids[:seq_len], out[:seq_len])


@dataclass
class StepwiseSet:
    """The rows of a process-reward-model run (one example a row, padded; labels -100 but at the
    step separators)."""

    rows: list[StepwiseRow]
    vocab_size: int
    pad_id: int
    name: str
    num_labels: int = 2
    stats: list = field(default_factory=list)
    held_out_rows: list = field(default_factory=list)     # (every step labelled: TRL's is_eval)

    batch_dims = {"tokens": "batch seq", "labels": "batch seq"}
    unit = "examples"

    def __len__(self) -> int:
        return len(self.rows)

    def sequences(self) -> list[list[int]]:
        return [s for r in self.rows for s in (r.tokens, r.labels)]

    def batch_rows(self, indices: Any, seq_len: int, weights: Any = None) -> dict[str, np.ndarray]:
        """``tokens`` (padded with ``pad_id``) and ``labels`` (-100 past the row and for the
        rows of weight 0: an evaluation's wrapped rows)."""
        toks = np.stack([_padded(self.rows[j].tokens, seq_len, self.pad_id) for j in indices])
        labels = np.full((len(indices), seq_len), IGNORE, dtype=np.int64)
        for k, j in enumerate(indices):
            r = self.rows[j].labels[:seq_len]
            labels[k, :len(r)] = r
        if weights is not None:
            labels[np.asarray(weights) == 0] = IGNORE
        return {"tokens": toks, "labels": labels}

    def split(self, n_val: int, seed: int) -> tuple["StepwiseSet", "StepwiseSet"]:
        """``(train, held out)``; the held-out rows label every step (TRL's ``is_eval``)."""
        held = set(np.random.default_rng([seed, 7]).permutation(len(self.rows))[len(self.rows) - n_val:].tolist())
        evals = self.held_out_rows or self.rows
        return (replace(self, rows=[x for i, x in enumerate(self.rows) if i not in held], held_out_rows=[]),
                replace(self, rows=[x for i, x in enumerate(evals) if i in held], held_out_rows=[],
                        name=f"{self.name}[val]"))


def build_stepwise(entries: list, tokenizer: Any, *, seq_len: int, num_labels: int = 2) -> StepwiseSet:
    """The rows of ``datasets:`` entries of type ``stepwise_supervised`` (``step_separator``,
    default "\\n"; ``max_completion_length``; ``train_on_last_step_only``); a label outside
    ``0 .. num_labels - 1`` is an error naming the record."""
    tok = tokenizer or ByteTokenizer()
    rows, evals = [], []
    for i, entry in enumerate(entries):
        where = f"datasets[{i}]: {entry.path}"
        if entry.type not in STEPWISE_TYPES:
            raise ValueError(f"datasets[{i}]: type {entry.type!r}: process_reward_model reads "
                             f"{', '.join(STEPWISE_TYPES)} rows")
        if not Path(entry.path).exists():
            raise FileNotFoundError(f"{where}: no such file or directory")
        sep = getattr(entry, "step_separator", None)
        kw = dict(step_separator="\n" if sep is None else sep, seq_len=seq_len,
                  max_completion_length=getattr(entry, "max_completion_length", None),
                  train_on_last_step_only=bool(getattr(entry, "train_on_last_step_only", False)))
        for n, rec in enumerate(_records(Path(entry.path), entry.ds_type, entry.split, where), start=1):
            row = stepwise_row(tok, rec, is_eval=False, where=where, n=n, **kw)
            bad = [x for x in row.labels if x != IGNORE and not 0 <= x < num_labels]
            if bad:
                raise ValueError(f"{where}: record {n}: step label {bad[0]} is not in 0..{num_labels - 1} "
                                 f"(num_labels {num_labels})")
            rows.append(row)
            evals.append(stepwise_row(tok, rec, is_eval=True, where=where, n=n, **kw)
                         if kw["train_on_last_step_only"] else row)
    if not rows:
        raise ValueError(f"the datasets {', '.join(Path(e.path).name for e in entries)} hold no record")
    return StepwiseSet(rows, int(tok.vocab_size), pad_id_of(tok), ", ".join(Path(e.path).name for e in entries),
                       num_labels, held_out_rows=evals)
