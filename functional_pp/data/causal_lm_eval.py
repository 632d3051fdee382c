"""Axolotl's ``do_causal_lm_eval`` with ``eval_causal_lm_metrics: [perplexity]``: what its
``CausalLMBenchEvalCallback`` and ``Perplexity`` metric (``axolotl/utils/callbacks/perplexity.py``)
compute, as data here (docs/finetune.md "Perplexity").

At each evaluation Axolotl takes every held-out row's trained tokens (``labels != -100``), decodes
them (``skip_special_tokens=True``): the *references*; tokenizes them again as one batch (special
tokens added, padded to the longest with the tokenizer's pad token, else its EOS, on its padding
side, truncated to its ``model_max_length``); and slides windows of ``eval_max_new_tokens`` tokens
starting every ``stride`` = 512 tokens over that batch (HF's perplexity recipe: in a window only
the tokens not scored by the previous one are labels). Each window's loss is the model's mean
token loss over the window's labels, padding included (no attention mask is passed); the
perplexity is ``exp`` of the mean of the windows' losses.

:func:`perplexity_windows` builds those windows, each as a token stream of rows of ``seq_len``
tokens (the row, then filler that trains no label), for the ordinary held-out evaluation
(``app/evaluate.py``), whose mean token loss over a stream is the window's loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["STRIDE", "references", "reference_ids", "perplexity_windows", "PerplexityWindow"]

#: Axolotl's ``Perplexity(stride=512)`` (the callback leaves it at its default)
STRIDE = 512


def _documents(tokens: np.ndarray, eos_id: int | None, first: np.ndarray | None = None) -> list[slice]:
    """Each document of a held-out stream (documents end with ``eos_id``, a last one may not; or,
    ``first`` given, each starts where it is 1)."""
    if first is not None:
        ends = np.flatnonzero(np.asarray(first)[1:] != 0) + 1
    elif eos_id is None:
        return [slice(0, len(tokens))]
    else:
        ends = np.flatnonzero(tokens == eos_id) + 1
    starts = np.concatenate([[0], ends])
    stops = np.concatenate([ends, [len(tokens)]])
    return [slice(int(a), int(b)) for a, b in zip(starts, stops) if b > a]


def references(val, tokenizer) -> list[str]:
    """The text of each held-out row's trained tokens (``val``: the held-out
    :class:`~functional_pp.data.formats.TokenStream`), decoded without special tokens: Axolotl's
    ``completion_texts``."""
    tokens = np.asarray(val.tokens)
    trained = None if val.trained is None else np.asarray(val.trained)
    out = []
    for doc in _documents(tokens, val.eos_id, getattr(val, "starts", None)):
        ids = tokens[doc] if trained is None else tokens[doc][trained[doc] != 0]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out


def reference_ids(refs: list[str], tokenizer) -> tuple[np.ndarray, int]:
    """``(ids [rows, longest], pad id)``: the references tokenized as transformers' tokenizer call
    ``tokenizer(refs, padding=True, truncation=True)`` makes them (special tokens added by the
    tokenizer's post-processor; padded on its ``padding_side`` with its pad token, else its EOS:
    Axolotl's fallback; cut to its ``model_max_length``)."""
    pad = tokenizer.special_tokens.get("pad_token") or tokenizer.special_tokens.get("eos_token")
    pad_id = tokenizer.tok.token_to_id(pad) if pad else tokenizer.eos_id
    if pad_id is None:
        raise ValueError("do_causal_lm_eval: the tokenizer has neither a pad token nor an EOS token to pad the "
                         "references with: give special_tokens: {pad_token: ...}")
    limit = tokenizer.model_max_length
    rows = [tokenizer.tok.encode(r, add_special_tokens=True).ids[:limit] for r in refs]
    longest = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), longest), pad_id, dtype=np.int64)
    for i, r in enumerate(rows):
        if tokenizer.padding_side == "left":
            out[i, longest - len(r):] = r
        else:
            out[i, :len(r)] = r
    return out, int(pad_id)


@dataclass(frozen=True)
class PerplexityWindow:
    """One window of the references: ``tokens`` and ``trained`` (a label where 1) as one stream
    of ``rows`` rows of ``seq_len`` tokens, plus one filler token (a loader's last label)."""
    tokens: np.ndarray
    trained: np.ndarray
    rows: int


def perplexity_windows(ids: np.ndarray, max_seq_len: int, seq_len: int, filler: int,
                       stride: int = STRIDE) -> list[PerplexityWindow]:
    """Axolotl's windows over the references ``ids`` (``[rows, length]``): ``begin`` every
    ``stride`` tokens, ``end = min(begin + max_seq_len, length)``, the labels the window's last
    ``end - previous end`` tokens (every one after the first, which nothing predicts), up to the
    window that reaches the end. Each row of a window is laid out in ``seq_len`` tokens, followed
    by ``filler`` tokens that train no label (a model is causal: they change no earlier logit)."""
    if max_seq_len > seq_len:
        raise ValueError(f"eval_max_new_tokens={max_seq_len} (the perplexity window) is longer than "
                         f"sequence_len={seq_len}: lower eval_max_new_tokens")
    n, length = ids.shape
    out, prev_end = [], 0
    for begin in range(0, length, stride):
        end = min(begin + max_seq_len, length)
        trg_len = end - prev_end
        width = end - begin
        tokens = np.full(n * seq_len + 1, filler, dtype=np.int64)
        trained = np.zeros(n * seq_len + 1, dtype=np.uint8)
        first_label = max(1, width - trg_len)
        for i in range(n):
            tokens[i * seq_len:i * seq_len + width] = ids[i, begin:end]
            trained[i * seq_len + first_label:i * seq_len + width] = 1
        out.append(PerplexityWindow(tokens, trained, n))
        prev_end = end
        if end == length:
            break
    return out
