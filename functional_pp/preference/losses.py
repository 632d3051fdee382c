"""The preference losses as pure functions of per-sequence log-probabilities (tensors of
shape ``[batch]``), TRL's formulas (``DPOTrainer``, ``ORPOTrainer``, ``CPOTrainer``,
``KTOTrainer``): each returns the per-sequence losses (the objective is their mean) and the
rewards TRL logs. Elementwise over the batch, so they apply unchanged to each device's block
of a split batch (docs/preference.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["DPO_LOSS_TYPES", "CPO_LOSS_TYPES", "PairLosses", "dpo_losses", "orpo_losses", "cpo_losses",
           "kto_losses", "log1mexp"]

#: TRL DPOTrainer's loss types built here (``dpo_loss_type``; ``rl: ipo`` is ``ipo``)
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
#: TRL CPOTrainer's loss types (``rl: simpo`` is ``simpo``)
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


@dataclass
class PairLosses:
    """Per-sequence losses and the rewards TRL logs (detached), all ``[batch]``."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _check_choice(what: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(choices)}")


def dpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
               ref_rejected_logps: torch.Tensor, *, beta: float, loss_type: str = "sigmoid",
               label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
               rejected_tokens: torch.Tensor | None = None) -> PairLosses:
    """DPO (TRL ``DPOTrainer``, reverse KL): the log-ratios against the reference, and
    ``sigmoid`` ``-logsigmoid(beta d)``, ``hinge`` ``relu(1 - beta d)``, ``robust`` (label
    smoothing ``eps``: ``(-(1-eps) logsigmoid(beta d) + eps logsigmoid(-beta d)) / (1 - 2 eps)``)
    or ``ipo`` ``(d / tokens - 1/(2 beta))^2`` with each log-ratio divided by its completion's
    token count (``chosen_tokens``, ``rejected_tokens``), ``d`` the chosen minus the rejected
    log-ratio."""
    _check_choice("dpo loss_type", loss_type, DPO_LOSS_TYPES)
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "robust":
        eps = label_smoothing
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    else:
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo loss_type 'ipo' needs the completions' token counts (chosen_tokens, rejected_tokens)")
        per_token = chosen_ratio / chosen_tokens.clamp(min=1.0) - rejected_ratio / rejected_tokens.clamp(min=1.0)
        losses = (per_token - 1 / (2 * beta)) ** 2
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (``log(-expm1(x))`` near 0,
    ``log1p(-exp(x))`` far from it)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_losses(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, *,
                beta: float) -> tuple[PairLosses, torch.Tensor]:
    """ORPO's odds-ratio term (TRL ``ORPOTrainer.odds_ratio_loss``) of the completions'
    *mean* token log-probabilities: the per-sequence losses ``-beta logsigmoid(log_odds)`` (the
    objective adds the chosen sequences' NLL) and ``log_odds`` itself."""
    c, r = chosen_mean_logps.float(), rejected_mean_logps.float()
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    return PairLosses(-beta * F.logsigmoid(log_odds), beta * c.detach(), beta * r.detach()), log_odds


def cpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float,
               loss_type: str = "sigmoid", simpo_gamma: float = 0.5,
               label_smoothing: float = 0.0) -> PairLosses:
    """CPO / SimPO (TRL ``CPOTrainer.cpo_loss``, no reference): ``d`` the chosen minus the
    rejected log-probability (mean per token for ``simpo`` and ``ipo``: the caller passes
    means), less ``simpo_gamma / beta`` for ``simpo``; ``sigmoid`` / ``simpo`` with label
    smoothing, ``hinge``, ``ipo`` as :func:`dpo_losses` without the reference."""
    _check_choice("cpo loss_type", loss_type, CPO_LOSS_TYPES)
    delta = chosen_logps - rejected_logps
    if loss_type == "simpo":
        delta = delta - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        eps = label_smoothing
        losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:
        losses = (delta - 1 / (2 * beta)) ** 2
    return PairLosses(losses, beta * chosen_logps.detach(), beta * rejected_logps.detach())


def kto_losses(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, *,
               beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple:
    """KTO (TRL ``KTOTrainer``, ``loss_type='kto'``) of unpaired completions: ``desirable``
    (bool ``[batch]``) ``1 - sigmoid(beta (ratio - kl))``, undesirable
    ``1 - sigmoid(beta (kl - ratio))``, weighted; ``kl`` the batch's (detached, clamped at 0)
    KL estimate. Returns ``(weighted losses, rewards)``, both ``[batch]``."""
    ratio = logps - ref_logps
    kl = kl.detach().clamp(min=0)
    good = desirable.bool()
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return losses, beta * ratio.detach()
