"""EBFT's strided rollout (docs/preference.md "EBFT"), composed from GRPO's sampling and the
pure functions of :mod:`.ebft`: for each document of a step, its blocks' anchors, ``n`` samples
of ``generate_max_len`` tokens per block (:func:`~functional_pp.preference.rollout.sample_completions`
on the prompts ``doc[:a]``, no stop token, left-padded into calls of at most the cache of the
step's documents x samples at the last anchor: :func:`call_tokens`), the frozen feature model's block features of the
samples and of the document, the rewards and advantages per block, and the training batch whose
loss is one weighted sum of token log-probabilities
(:func:`~functional_pp.preference.weighted_logps.weighted_logps_objective`).

The feature model and the policy see each document once, as one block-parallel row holding
every sample (:mod:`.ebft_layout`), which computes what a row ``doc[:a] + sample`` per sample
would. Each sampled token's log-probability is taken from the position that sampled it, where
Axolotl's strided forward reads the position before the token in its interleaved layout
(another block's); the loss is each document's mean over its sampled
tokens of ``-A log p`` times ``rl_coef`` plus ``ce_coef`` times its cross-entropy (the labelled
tokens of the document), averaged over the step's documents (Axolotl's with one document per
micro-batch, as its examples run).

A document is any object with ``tokens`` (``sequence_len`` ids), ``labels`` (the tokens the
cross-entropy trains, -100 elsewhere; position ``t``'s label is predicted at ``t - 1``) and
``prompt_length`` (None: no prompt): :class:`functional_pp.data.ebft_documents.Document`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from functional_pp.preference.ebft import block_advantages, block_rewards, row_block_features, strided_anchors
from functional_pp.preference.ebft_layout import block_parallel_row, empty_row, row_length, sample_starts
from functional_pp.preference.rollout import sample_completions

__all__ = ["EBFTRollout", "ebft_rollout", "call_tokens", "row_length_of", "score_samples", "ebft_batch", "ebft_metrics"]


@dataclass
class EBFTRollout:
    """A step's samples and their scores, per document: ``anchors[d]`` (``B_d``), ``samples[d]``
    ``[B_d, n, generate_max_len]``, ``rewards`` / ``alignment`` / ``diversity`` / ``advantages``
    ``[B_d, n]``."""

    documents: list
    anchors: list[list[int]]
    samples: list[torch.Tensor]
    rewards: list[torch.Tensor]
    alignment: list[torch.Tensor]
    diversity: list[torch.Tensor]
    advantages: list[torch.Tensor]


def _anchors(doc: Any, spec: Any) -> list[int]:
    return strided_anchors(len(doc.tokens), stride=spec.stride, context_length=spec.context_length,
                           generate_max_len=spec.generate_max_len, prompt_length=doc.prompt_length,
                           min_completion_prefix=spec.min_completion_prefix)


def ebft_rollout(policy: Callable, params: Any, documents: Sequence[Any], spec: Any,
                 feature_states: Callable[[torch.Tensor], list[torch.Tensor]], *, pad_id: int, key: int, step: int,
                 row_multiple: int = 1, stream: int = 0) -> EBFTRollout:
    """Sample and score one step's ``documents`` with ``spec``'s
    (:class:`~functional_pp.preference.ebft_spec.EBFTSpec`) settings: ``policy(params, tokens)``
    the logits to sample from, ``feature_states(tokens [N, S])`` the frozen model's hidden states
    of the feature layers (``[N, S, H]`` each)."""
    n, gen = spec.n_samples_per_prompt, spec.generate_max_len
    anchors = [_anchors(d, spec) for d in documents]
    prompts = [list(d.tokens[:a]) for d, doc_anchors in zip(documents, anchors) for a in doc_anchors]
    completions: list[list[int]] = []
    if prompts:
        completions, _ = sample_completions(policy, params, prompts, num_generations=n, max_completion_length=gen,
                                            stop_ids=[], pad_id=pad_id, temperature=spec.temperature,
                                            top_p=spec.top_p, key=key, step=step, row_multiple=row_multiple,
                                            stream=stream, max_call_tokens=call_tokens(
                                                len(documents) * n, max(len(p) for p in prompts), gen, row_multiple))
    flat = torch.tensor(completions, dtype=torch.long).view(-1, n, gen)
    counts = [len(a) for a in anchors]
    samples = list(torch.split(flat, counts)) if prompts else [torch.zeros(0, n, gen, dtype=torch.long)
                                                                for _ in documents]
    return score_samples(documents, samples, spec, feature_states, pad_id=pad_id)


def call_tokens(rows: int, last_anchor: int, generate_max_len: int, row_multiple: int = 1) -> int:
    """The key / value cache positions a step's sampling call may hold: its documents x samples
    rows (padded to ``row_multiple``) at its last anchor, plus the sampled tokens; the rows of
    earlier anchors (shorter prompts) fill calls of as many positions."""
    return -(-rows // max(1, row_multiple)) * max(1, row_multiple) * (last_anchor + generate_max_len)


def row_length_of(spec: Any, seq_len: int, multiple: int = 1) -> int:
    """The block-parallel rows' length of documents of ``seq_len`` tokens under ``spec``: room for
    the most blocks a document can have (its anchors from ``context_length``), rounded up to a
    multiple of ``multiple`` (context parallelism's chunks)."""
    most = len(strided_anchors(seq_len, stride=spec.stride, context_length=spec.context_length,
                               generate_max_len=spec.generate_max_len))
    length = row_length(seq_len, most, spec.n_samples_per_prompt, spec.generate_max_len)
    return -(-length // multiple) * multiple


def _stacked(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def score_samples(documents: Sequence[Any], samples: Sequence[torch.Tensor], spec: Any,
                  feature_states: Callable[[dict], list[torch.Tensor]], *, pad_id: int) -> EBFTRollout:
    """The rewards and advantages of given samples (``samples[d]`` ``[B_d, n, generate_max_len]``,
    at document ``d``'s anchors): the feature model runs once over each document's
    block-parallel row (:mod:`.ebft_layout`: ``feature_states(rows)`` of the rows' ``tokens``,
    ``segments``, ``position_ids`` and ``prefix``, ``[N, L]`` each); each block's features are
    pooled from its tokens' positions, the reference's from the document's own."""
    n, gen = spec.n_samples_per_prompt, spec.generate_max_len
    anchors = [_anchors(d, spec) for d in documents]
    for d, (a, s) in enumerate(zip(anchors, samples)):
        if tuple(s.shape) != (len(a), n, gen):
            raise ValueError(f"ebft: document {d}'s samples are {tuple(s.shape)}, expected {(len(a), n, gen)} (blocks "
                             f"x n_samples_per_prompt x generate_max_len)")
    out = EBFTRollout(list(documents), anchors, list(samples), [], [], [], [])
    scored = [d for d, a in enumerate(anchors) if a]
    if not scored:
        out.rewards = out.alignment = out.diversity = out.advantages = [torch.zeros(0, n) for _ in documents]
        return out
    seq_len = len(documents[0].tokens)
    length = row_length_of(spec, seq_len)
    rows = _stacked([block_parallel_row(documents[d].tokens, anchors[d], samples[d], length, pad_id)
                     for d in scored])
    with torch.no_grad():
        states = [h.detach().to(torch.float32) for h in feature_states(rows)]
    for i, d in enumerate(scored):
        b = len(anchors[d])
        own = [h[i:i + 1] for h in states]
        starts = sample_starts(seq_len, b, n, gen).reshape(-1) + 1
        phi = row_block_features(own, starts, gen, spec.embed_method, torch.zeros_like(starts))
        ref = row_block_features(own, torch.tensor(anchors[d]), gen, spec.embed_method,
                                 torch.zeros(b, dtype=torch.long))
        r, al, dv = block_rewards(phi.view(b, n, -1), ref, alignment_coef=spec.alignment_coef,
                                  diversity_coef=spec.diversity_coef, use_whitening=spec.use_whitening)
        out.rewards.append(r)
        out.alignment.append(al)
        out.diversity.append(dv)
        out.advantages.append(block_advantages(r, spec.advantage_estimator))
    for d in range(len(documents)):      # (documents without a block: no rewards, in their place)
        if not anchors[d]:
            for xs in (out.rewards, out.alignment, out.diversity, out.advantages):
                xs.insert(d, torch.zeros(0, n))
    return out


def ebft_batch(r: EBFTRollout, spec: Any, pad_id: int, row_multiple: int = 1,
               length_multiple: int = 1) -> dict[str, torch.Tensor]:
    """The step's training batch (``batch seq`` each): a block-parallel row per document with
    blocks (:mod:`.ebft_layout`), each sample's tokens labelled at the positions that sampled
    them (its segment's copied context token, then its own tokens but the last), weighted
    ``rl_coef * A / (the document's sampled tokens) / documents``; with ``ce_coef`` the
    document's labelled tokens too, weighted ``ce_coef / (the document's labelled tokens) /
    documents``; empty rows (no labels) up to a multiple of ``row_multiple``, the rows' length a
    multiple of ``length_multiple``; ``step_tokens`` the labelled tokens of the whole batch."""
    docs, n, gen = r.documents, spec.n_samples_per_prompt, spec.generate_max_len
    seq_len = len(docs[0].tokens)
    length = row_length_of(spec, seq_len, length_multiple)
    rows = []

    def labelled(row: dict, lab: list[tuple[int, int]], w: float) -> dict:
        row["labels"] = torch.full((length,), -100, dtype=torch.long)
        row["weights"] = torch.zeros(length, dtype=torch.float32)
        for pos, label in lab:
            row["labels"][pos], row["weights"][pos] = label, w
        return row
    for d, doc in enumerate(docs):
        b = len(r.anchors[d])
        if not b:
            continue
        row = labelled(block_parallel_row(doc.tokens, r.anchors[d], r.samples[d], length, pad_id), [], 0.0)
        starts = sample_starts(seq_len, b, n, gen)
        per_token = spec.rl_coef * r.advantages[d].to(torch.float32) / (b * n * gen) / len(docs)
        at = (starts.unsqueeze(-1) + torch.arange(gen)).reshape(-1)
        row["labels"][at] = r.samples[d].reshape(-1).to(torch.long)
        row["weights"][at] = per_token.unsqueeze(-1).expand(b, n, gen).reshape(-1)
        if spec.ce_coef:
            targets = [(t - 1, lab) for t, lab in enumerate(doc.labels) if t > 0 and lab != -100]
            for pos, lab in targets:
                row["labels"][pos], row["weights"][pos] = lab, spec.ce_coef / len(targets) / len(docs)
        rows.append(row)
    if not rows:
        raise ValueError(f"ebft: none of the step's {len(docs)} documents has a block (a document needs "
                         f"context_length {spec.context_length} (or its prompt and min_completion_prefix) + "
                         f"generate_max_len {gen} tokens); lengthen sequence_len or shorten the blocks")
    while len(rows) % max(1, row_multiple):
        rows.append(labelled(empty_row(length, pad_id), [], 0.0))
    out = _stacked(rows)
    out["step_tokens"] = torch.full(out["tokens"].shape, float((out["labels"] != -100).sum()))
    return out


def ebft_metrics(r: EBFTRollout) -> dict[str, float]:
    """Axolotl's logged EBFT values (``ebft/`` written ``ebft_``): the mean reward, alignment and
    diversity over the step's samples and the advantages' standard deviation, and the blocks."""
    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([x.reshape(-1) for x in xs]) if xs else torch.zeros(0)
    rewards, adv = cat(r.rewards), cat(r.advantages)
    if not rewards.numel():
        return {"ebft_blocks": 0.0}
    return {"ebft_mean_reward": float(rewards.mean()), "ebft_alignment": float(cat(r.alignment).mean()),
            "ebft_diversity": float(cat(r.diversity).mean()),
            "ebft_advantages_std": float(adv.std()) if adv.numel() > 1 else 0.0,
            "ebft_blocks": float(sum(len(a) for a in r.anchors))}
