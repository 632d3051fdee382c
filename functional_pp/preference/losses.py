"""The preference losses as pure functions of per-sequence log-probabilities (tensors of
shape ``[batch]``), TRL's formulas (``DPOTrainer``, ``ORPOTrainer``, ``CPOTrainer``,
``KTOTrainer``): each returns the per-sequence losses (the objective is their mean) and the
rewards TRL logs. Elementwise over the batch, so they apply unchanged to each device's block
of a split batch (docs/preference.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["DPO_LOSS_TYPES", "DPO_PAIR_LOSSES", "DPO_NOT_BUILT", "CPO_LOSS_TYPES", "KTO_LOSS_TYPES", "PairLosses",
           "dpo_loss_terms", "dpo_losses", "orpo_losses", "cpo_losses", "kto_losses", "log1mexp"]

#: TRL DPOTrainer's loss types built here (``dpo_loss_type``, one or a list; ``rl: ipo`` is ``ipo``):
#: the per-pair ones of :data:`DPO_PAIR_LOSSES`, and ``sft`` (the chosen completions' token-mean NLL over
#: the batch, added by the objective: it is not a per-pair loss)
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
                  "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft")
#: TRL's loss types that sort the log-ratios over the batch (not per pair) -> not built
DPO_NOT_BUILT = ("aot", "aot_unpaired")
#: TRL CPOTrainer's loss types (``rl: simpo`` is ``simpo``)
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
#: TRL KTOTrainer's loss types (``kto_loss_type``): ``apo_zero_unpaired`` has no KL term
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass
class PairLosses:
    """Per-sequence losses and the rewards TRL logs (detached), all ``[batch]``."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _check_choice(what: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(choices)}")


def _dpo_terms(c, r, d, nc, nr, beta, eps, tau) -> dict:
    """TRL 1.16 ``DPOTrainer._compute_loss``'s per-pair losses: ``c`` / ``r`` the chosen /
    rejected log-ratios against the reference, ``d = c - r``, ``nc`` / ``nr`` the completions'
    token counts (``ipo``, ``sigmoid_norm``), ``eps`` the label smoothing, ``tau`` DiscoPOP's."""
    def per_token():
        if nc is None or nr is None:
            raise ValueError("dpo loss_type 'ipo' / 'sigmoid_norm' needs the completions' token counts "
                             "(chosen_tokens, rejected_tokens)")
        return c / nc.clamp(min=1.0) - r / nr.clamp(min=1.0)
    ls = F.logsigmoid
    return {
        "sigmoid": lambda: -ls(beta * d),
        "hinge": lambda: torch.relu(1 - beta * d),
        "ipo": lambda: (per_token() - 1 / (2 * beta)) ** 2,
        "robust": lambda: (-(1 - eps) * ls(beta * d) + eps * ls(-beta * d)) / (1 - 2 * eps),
        "exo_pair": lambda: (torch.sigmoid(beta * d) * (ls(beta * d) - math.log1p(-eps))
                             + torch.sigmoid(-beta * d) * (ls(-beta * d) - math.log(eps))),
        "nca_pair": lambda: -ls(beta * c) - 0.5 * ls(-beta * c) - 0.5 * ls(-beta * r),
        "bco_pair": lambda: -ls(beta * c) - ls(-beta * r),
        "sppo_hard": lambda: (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2,
        "apo_zero": lambda: 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r),
        "apo_down": lambda: torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * d),
        "discopop": lambda: (-ls(beta * d) * (1 - torch.sigmoid(beta * d / tau))
                             + torch.exp(-beta * d) * torch.sigmoid(beta * d / tau)),
        "sigmoid_norm": lambda: -ls(beta * per_token()),
    }


#: the per-pair DPO loss types (:func:`dpo_losses`)
DPO_PAIR_LOSSES = tuple(t for t in DPO_LOSS_TYPES if t != "sft")


def dpo_loss_terms(loss_type: str | Sequence[str], loss_weights: Sequence[float] | None = None
                   ) -> tuple[tuple[str, float], ...]:
    """``(loss type, weight)`` pairs of TRL's ``loss_type`` (one or a list) and ``loss_weights``
    (default 1.0 each); a :class:`ValueError` names an unknown type or a length mismatch."""
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not types:
        raise ValueError("dpo loss_type is an empty list: give at least one loss type")
    for t in types:
        if t in DPO_NOT_BUILT:
            raise ValueError(f"dpo loss_type {t!r} sorts the log-ratios over the batch (AOT), which is not built; "
                             f"choose one of {', '.join(DPO_LOSS_TYPES)}")
        _check_choice("dpo loss_type", t, DPO_LOSS_TYPES)
    weights = (1.0,) * len(types) if loss_weights is None else tuple(float(w) for w in loss_weights)
    if len(weights) != len(types):
        raise ValueError(f"dpo loss_weights gives {len(weights)} weights for {len(types)} loss types "
                         f"({', '.join(types)}): give one weight per loss type")
    return tuple(zip(types, weights))


def dpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
               ref_rejected_logps: torch.Tensor, *, beta: float, loss_type: str | Sequence[str] = "sigmoid",
               loss_weights: Sequence[float] | None = None, label_smoothing: float = 0.0,
               discopop_tau: float = 0.05, chosen_tokens: torch.Tensor | None = None,
               rejected_tokens: torch.Tensor | None = None) -> PairLosses:
    """DPO (TRL ``DPOTrainer``, reverse KL): the weighted sum of the per-pair losses of
    ``loss_type`` (one of :data:`DPO_PAIR_LOSSES` or a list, weighted by ``loss_weights``; the
    formulas in :func:`_dpo_terms` and docs/preference.md), and the rewards ``beta`` times the
    log-ratios. ``sft`` is not a per-pair loss: the objective adds it (refused here); an empty
    list (``sft`` alone) gives zeros."""
    empty = not isinstance(loss_type, str) and len(loss_type) == 0
    terms = () if empty else dpo_loss_terms(loss_type, loss_weights)
    if any(t == "sft" for t, _ in terms):
        raise ValueError("dpo loss_type 'sft' is the chosen completions' token mean over the batch, not a per-pair "
                         "loss: preference_loss adds it (pass the other loss types here)")
    if any(t == "exo_pair" for t, _ in terms) and not 0 < label_smoothing < 1:
        raise ValueError(f"dpo loss_type 'exo_pair' needs a label smoothing in (0, 1) (TRL's; the EXO paper's "
                         f"1e-3), got {label_smoothing}")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    formulas = _dpo_terms(chosen_ratio, rejected_ratio, chosen_ratio - rejected_ratio, chosen_tokens,
                          rejected_tokens, beta, label_smoothing, discopop_tau)
    losses = torch.zeros_like(chosen_ratio)
    for name, weight in terms:
        losses = losses + weight * formulas[name]()
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
               beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
               loss_type: str = "kto") -> tuple:
    """KTO (TRL ``KTOTrainer``) of unpaired completions, ``ratio`` each one's log-ratio against
    the reference: ``loss_type='kto'`` a ``desirable`` (bool ``[batch]``) completion
    ``1 - sigmoid(beta (ratio - kl))``, an undesirable one ``1 - sigmoid(beta (kl - ratio))``,
    ``kl`` the batch's (detached, clamped at 0) KL estimate; ``'apo_zero_unpaired'`` (APO-zero,
    no KL term) ``1 - sigmoid(beta ratio)`` and ``sigmoid(beta ratio)``; weighted by
    ``desirable_weight`` / ``undesirable_weight``. Returns ``(weighted losses, rewards)``, both
    ``[batch]``."""
    _check_choice("kto loss_type", loss_type, KTO_LOSS_TYPES)
    ratio = logps - ref_logps
    good = desirable.bool()
    if loss_type == "kto":
        kl = kl.detach().clamp(min=0)
        good_loss, bad_loss = 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))
    else:
        good_loss, bad_loss = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    losses = torch.where(good, desirable_weight * good_loss, undesirable_weight * bad_loss)
    return losses, beta * ratio.detach()
