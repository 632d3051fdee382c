"""EBFT's strided rollout (docs/preference.md "EBFT"), composed from GRPO's sampling and the
pure functions of :mod:`.ebft`: for each document of a step, its blocks' anchors, ``n`` samples
of ``generate_max_len`` tokens per block (:func:`~functional_pp.preference.rollout.sample_completions`
on the prompts ``doc[:a]``, no stop token), the frozen feature model's block features of the
samples and of the document, the rewards and advantages per block, and the training batch whose
loss is one weighted sum of token log-probabilities
(:func:`~functional_pp.preference.weighted_logps.weighted_logps_objective`).

Each sampled token's log-probability is taken from the position that sampled it (its row is
``doc[:a] + sample``), where Axolotl's strided forward reads the position before the token in
its interleaved layout (another block's); the loss is each document's mean over its sampled
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
from functional_pp.preference.rollout import sample_completions

__all__ = ["EBFTRollout", "ebft_rollout", "score_samples", "ebft_batch", "ebft_metrics"]


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
                                            stream=stream)
    flat = torch.tensor(completions, dtype=torch.long).view(-1, n, gen)
    counts = [len(a) for a in anchors]
    samples = list(torch.split(flat, counts)) if prompts else [torch.zeros(0, n, gen, dtype=torch.long)
                                                                for _ in documents]
    return score_samples(documents, samples, spec, feature_states, pad_id=pad_id)


def score_samples(documents: Sequence[Any], samples: Sequence[torch.Tensor], spec: Any,
                  feature_states: Callable[[torch.Tensor], list[torch.Tensor]], *, pad_id: int) -> EBFTRollout:
    """The rewards and advantages of given samples (``samples[d]`` ``[B_d, n, generate_max_len]``,
    at document ``d``'s anchors): the feature model runs once over every sample's row ``doc[:a] +
    sample`` and every document; each block's features are pooled from its tokens' positions."""
    n, gen = spec.n_samples_per_prompt, spec.generate_max_len
    anchors = [_anchors(d, spec) for d in documents]
    for d, (a, s) in enumerate(zip(anchors, samples)):
        if tuple(s.shape) != (len(a), n, gen):
            raise ValueError(f"ebft: document {d}'s samples are {tuple(s.shape)}, expected {(len(a), n, gen)} (blocks "
                             f"x n_samples_per_prompt x generate_max_len)")
    out = EBFTRollout(list(documents), anchors, list(samples), [], [], [], [])
    total = sum(len(a) for a in anchors)
    if not total:
        out.rewards = out.alignment = out.diversity = out.advantages = [torch.zeros(0, n) for _ in documents]
        return out
    seq_len = len(documents[0].tokens)
    rows = torch.full((total * n + len(documents), seq_len), pad_id, dtype=torch.long)
    i = 0
    for doc, doc_anchors, s in zip(documents, anchors, samples):
        for b, a in enumerate(doc_anchors):
            for j in range(n):
                rows[i, :a] = torch.tensor(doc.tokens[:a])
                rows[i, a:a + gen] = s[b, j]
                i += 1
    for d, doc in enumerate(documents):
        rows[total * n + d] = torch.tensor(doc.tokens)
    with torch.no_grad():
        states = [h.detach().to(torch.float32) for h in feature_states(rows)]
    starts = torch.tensor([a for doc_anchors in anchors for a in doc_anchors])
    phi = row_block_features([h[:total * n] for h in states], starts.repeat_interleave(n), gen, spec.embed_method)
    doc_rows = torch.tensor([total * n + d for d, doc_anchors in enumerate(anchors) for _ in doc_anchors])
    ref = row_block_features([h[doc_rows] for h in states], starts, gen, spec.embed_method)
    row = 0
    for doc_anchors in anchors:
        b = len(doc_anchors)
        r, al, dv = block_rewards(phi[row * n:(row + b) * n].view(b, n, -1), ref[row:row + b],
                                  alignment_coef=spec.alignment_coef, diversity_coef=spec.diversity_coef,
                                  use_whitening=spec.use_whitening)
        out.rewards.append(r)
        out.alignment.append(al)
        out.diversity.append(dv)
        out.advantages.append(block_advantages(r, spec.advantage_estimator))
        row += b
    return out


def ebft_batch(r: EBFTRollout, spec: Any, pad_id: int, row_multiple: int = 1) -> dict[str, torch.Tensor]:
    """The step's training batch (``batch seq`` each): a row per sample, ``doc[:a] + sample``
    padded with ``pad_id``, its labels the sample's tokens at the positions that sampled them,
    weighted ``rl_coef * A / (the document's sampled tokens) / documents``; with ``ce_coef`` a row
    per document, its labelled tokens weighted ``ce_coef / (the document's labelled tokens) /
    documents``; empty rows (no labels) up to a multiple of ``row_multiple``; ``step_tokens`` the
    labelled tokens of the whole batch."""
    docs, gen = r.documents, spec.generate_max_len
    seq_len = len(docs[0].tokens)
    tokens, labels, weights = [], [], []

    def add(tok: list[int], lab: list[tuple[int, int]], w: float) -> None:
        t = torch.full((seq_len,), pad_id, dtype=torch.long)
        t[:len(tok)] = torch.tensor(tok, dtype=torch.long)
        lb = torch.full((seq_len,), -100, dtype=torch.long)
        wt = torch.zeros(seq_len, dtype=torch.float32)
        for pos, label in lab:
            lb[pos], wt[pos] = label, w
        tokens.append(t)
        labels.append(lb)
        weights.append(wt)
    for d, doc in enumerate(docs):
        count = len(r.anchors[d]) * spec.n_samples_per_prompt * gen
        for b, a in enumerate(r.anchors[d]):
            for j in range(spec.n_samples_per_prompt):
                sample = r.samples[d][b, j].tolist()
                add(list(doc.tokens[:a]) + sample, [(a - 1 + k, t) for k, t in enumerate(sample)],
                    spec.rl_coef * float(r.advantages[d][b, j]) / count / len(docs))
        if spec.ce_coef and r.anchors[d]:
            targets = [(t - 1, lab) for t, lab in enumerate(doc.labels) if t > 0 and lab != -100]
            if targets:
                add(list(doc.tokens), targets, spec.ce_coef / len(targets) / len(docs))
    if not tokens:
        raise ValueError(f"ebft: none of the step's {len(docs)} documents has a block (a document needs "
                         f"context_length {spec.context_length} (or its prompt and min_completion_prefix) + "
                         f"generate_max_len {gen} tokens); lengthen sequence_len or shorten the blocks")
    while len(tokens) % max(1, row_multiple):
        add([], [], 0.0)
    out = {"tokens": torch.stack(tokens), "labels": torch.stack(labels), "weights": torch.stack(weights)}
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
