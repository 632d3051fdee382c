"""A loss that is one weighted sum of token log-probabilities, ``-sum_t w_t log p(label_t)``,
over every row and position of the batch (EBFT's policy gradient and cross-entropy terms: each
token's weight carries its coefficient, advantage and normaliser; docs/preference.md "EBFT")."""
from __future__ import annotations

from functional_pp import ops
from functional_pp.preference.ebft_layout import LAYOUT_KEYS
from functional_pp.preference.grpo import _constant

__all__ = ["weighted_logps_objective"]


def weighted_logps_objective(policy):
    """``loss(params, batch) = -sum weights * log p(labels)`` over the batch's rows and positions
    (``batch seq``: ``tokens``, ``labels`` (-100: no term), ``weights``); ``policy(params,
    tokens, **layout)`` gives the logits, ``layout`` the batch's entries of
    :data:`~functional_pp.preference.ebft_layout.LAYOUT_KEYS` (segments, position ids and shared
    context of block-parallel rows) where it has them. With ``step_tokens`` (the step's labelled tokens along each row)
    a micro-batch of an accumulated step is scaled so that the step's weighting of micro-batches
    by their share of the labels adds up to the whole step's sum. A sum over named arrays: every
    layout computes the one-device loss."""
    def loss(params, batch):
        labels = batch["labels"]
        layout = {k: batch[k] for k in LAYOUT_KEYS if k in batch}
        logps = ops.token_log_probs(policy(params, batch["tokens"], **layout), labels)
        total = ops.sum(ops.sum(logps * batch["weights"].astype(logps.data.dtype), "seq"), "batch")
        if "step_tokens" in batch:
            mask = labels.map(lambda t: (t != ops.IGNORE_INDEX).to(logps.data.dtype))
            count = ops.sum(ops.sum(mask, "seq"), "batch").map(lambda t: t.clamp(min=1.0))
            total = total * _constant(batch["step_tokens"]) / count
        return -total
    return loss
