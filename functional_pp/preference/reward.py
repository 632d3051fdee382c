"""Reward-model objectives (docs/reward_models.md): ``reward_model: true`` trains a sequence
score with TRL ``RewardTrainer``'s Bradley-Terry loss, ``process_reward_model: true`` a token
classifier of the steps' labels (TRL's ``PRMTrainer``: transformers' token-classification
cross-entropy at the step separators).

Bradley-Terry, per pair: ``-logsigmoid(r_chosen - r_rejected - margin)`` (the margin 0 where
the data has none), their mean over the batch, plus ``center_rewards_coefficient *
mean((r_chosen + r_rejected)^2)`` where given. The metrics TRL logs are reported: ``accuracy``
(r_chosen > r_rejected), ``margin`` (r_chosen - r_rejected), ``mean_reward``, ``min_reward``,
``max_reward`` over both sides, and ``rewards_chosen`` / ``rewards_rejected``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from functional_pp import ops
from functional_pp.core import step_values
from functional_pp.ops.elementwise import broadcast
from functional_pp.parallel.named import Named, settle

__all__ = ["RewardSpec", "bradley_terry_losses", "reward_loss", "process_reward_loss"]

Scores = Callable[..., Named]


@dataclass(frozen=True)
class RewardSpec:
    """A reward-model run: ``kind`` "reward" (Bradley-Terry pairs) or "process" (step labels)."""

    kind: str
    center_rewards_coefficient: float | None = None
    needs_reference = False

    def __post_init__(self) -> None:
        if self.kind not in ("reward", "process"):
            raise ValueError(f"reward kind {self.kind!r} is not one of reward, process")


def bradley_terry_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Per-pair ``-logsigmoid(chosen - rejected - margin)`` (TRL ``RewardTrainer``)."""
    delta = chosen - rejected
    return -F.logsigmoid(delta if margin is None else delta - margin)


def _weighted_mean(value: Named, rows: Named) -> Named:
    return ops.sum(value * rows, "batch") / ops.sum(rows, "batch")


def _row_value(along: Named, like: Named) -> Named:
    """Each row's value of a tensor repeated along ``seq`` (the margin, the pair weight), in
    ``like``'s dtype: the mean in float64, exact whatever part of the row each device holds."""
    return ops.mean(along.map(lambda t: t.to(torch.float64)), "seq").map(lambda t: t.to(like.data.dtype))


def _report(name: str, value: Named) -> None:
    step_values.report(name, settle(value).data.detach().float())


def reward_loss(spec: RewardSpec, scores: Scores) -> Callable[[Any, dict], Named]:
    """``loss(params, batch)`` over a batch of Bradley-Terry pairs (``data/reward_data.py``);
    ``scores(params, tokens, last)`` each sequence's scores (batch labels, one label)."""
    def loss(params: Any, batch: dict) -> Named:
        chosen = ops.sum(scores(params, batch["chosen_tokens"], batch["chosen_last"]), "labels")
        rejected = ops.sum(scores(params, batch["rejected_tokens"], batch["rejected_last"]), "labels")
        margin, rows = (_row_value(batch[k], chosen) for k in ("margin", "pair_weight"))
        per_pair = broadcast(bradley_terry_losses, [chosen, rejected, margin], "bradley_terry")
        out = _weighted_mean(per_pair, rows)
        if spec.center_rewards_coefficient:
            both = chosen + rejected
            out = out + _weighted_mean(both * both, rows) * spec.center_rewards_coefficient
        if step_values.active():
            good, bad = chosen.map(lambda t: t.detach().float()), rejected.map(lambda t: t.detach().float())
            _report("accuracy", _weighted_mean(broadcast(lambda a, b: (a > b).float(), [good, bad], "accuracy"), rows))
            _report("margin", _weighted_mean(good - bad, rows))
            _report("rewards_chosen", _weighted_mean(good, rows))
            _report("rewards_rejected", _weighted_mean(bad, rows))
            _report("mean_reward", _weighted_mean(good + bad, rows) * 0.5)
            _report("min_reward", broadcast(torch.minimum, [ops.min(good, "batch"), ops.min(bad, "batch")],
                                            "min_reward"))
            _report("max_reward", broadcast(torch.maximum, [ops.max(good, "batch"), ops.max(bad, "batch")],
                                            "max_reward"))
        return out
    return loss


def process_reward_loss(token_scores: Scores) -> Callable[[Any, dict], Named]:
    """``loss(params, batch)``: the mean cross-entropy of the step labels (``labels``, -100 but
    at the step separators) under ``token_scores(params, tokens)`` (batch seq labels), as
    transformers' ``*ForTokenClassification``."""
    def loss(params: Any, batch: dict) -> Named:
        logits = token_scores(params, batch["tokens"])
        return ops.cross_entropy(logits, batch["labels"], vocab="labels")
    return loss
