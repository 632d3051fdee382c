"""The training objective of ``rl: dpo | ipo | orpo | simpo | kto`` (docs/preference.md): a loss
``loss(params, batch)`` over a batch of pairs (``data/pair_loader.py``; KTO: unpaired
completions, ``data/unpaired.py``) for the training step, from a function giving the policy's
logits and, for DPO / IPO / KTO, the reference's.

Each side's completion log-probability is the sum of its tokens' log-probabilities
(:func:`functional_pp.ops.token_log_probs`, the vocabulary possibly split) over the sequence
(possibly split); the per-sequence losses (:mod:`.losses`, TRL's formulas) apply blockwise to
the batch, and their mean over the global batch is the loss. The rewards, margins,
accuracies and log-probabilities TRL logs are reported to the step's metrics."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from functional_pp import ops
from functional_pp.core import step_values
from functional_pp.ops.elementwise import broadcast
from functional_pp.parallel.named import Named, settle
from functional_pp.preference import losses as L

__all__ = ["PreferenceSpec", "METHODS", "sequence_logps", "preference_loss", "kto_loss"]

#: ``rl:`` methods -> whether they compare with a reference model
METHODS = {"dpo": True, "ipo": True, "orpo": False, "simpo": False, "kto": True}
Logits = Callable[[Any, Named], Named]


@dataclass(frozen=True)
class PreferenceSpec:
    """One preference method and its TRL arguments."""

    method: str                     # dpo | ipo | orpo | simpo | kto
    beta: float
    loss_type: str | tuple[str, ...] = "sigmoid"   # dpo: DPO_LOSS_TYPES, one or several (ipo: "ipo"); simpo: "simpo"
    loss_weights: tuple[float, ...] | None = None  # dpo: one weight per loss type (default 1.0 each)
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05      # dpo loss_type discopop (TRL's default)
    use_weighting: bool = False     # dpo: WPO's weights (TRL's use_weighting)
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    desirable_weight: float = 1.0   # kto
    undesirable_weight: float = 1.0
    kto_loss_type: str = "kto"      # kto: KTO_LOSS_TYPES

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"preference method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method in ("dpo", "ipo"):
            terms = L.dpo_loss_terms(self.loss_type, self.loss_weights)
            if self.use_weighting and any(t == "sft" for t, _ in terms):
                raise ValueError("dpo_use_weighting with dpo_loss_type sft is not built (TRL 1.16's DPOTrainer fails "
                                 "on it: it weighs the sft term's expanded batch mean in place); remove one of them")
        if self.use_weighting and self.method not in ("dpo", "ipo"):
            raise ValueError(f"dpo_use_weighting is read by rl: dpo / ipo only (this run has rl: {self.method})")
        if self.method == "kto" and self.kto_loss_type not in L.KTO_LOSS_TYPES:
            raise ValueError(f"kto_loss_type {self.kto_loss_type!r} is not one of {', '.join(L.KTO_LOSS_TYPES)}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        for key in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, key) > 0:
                raise ValueError(f"kto_{key} must be > 0, got {getattr(self, key)}")

    @property
    def needs_reference(self) -> bool:
        return METHODS[self.method]


def sequence_logps(logits: Named, labels: Named) -> tuple[Named, Named]:
    """Each sequence's summed log-probability of its labelled tokens and their count (both
    named ``batch``); ``logits`` (batch seq vocab), ``labels`` (batch seq, -100 ignored)."""
    token = ops.token_log_probs(logits, labels)
    counts = labels.map(lambda t: (t != ops.IGNORE_INDEX).to(token.data.dtype))
    return ops.sum(token, "seq"), ops.sum(counts, "seq")


def _per_sequence(fn: Callable, operands: list, name: str) -> Named:
    return broadcast(fn, operands, name)


def _batch_mean(value: Named, weight: Named | None) -> Named:
    """The mean over the batch, or weighted by each row's ``pair_weight`` (an evaluation's
    wrapped last batch holds pairs of weight 0: data/pair_loader.py)."""
    if weight is None:
        return ops.mean(value, "batch")
    rows = ops.mean(weight, "seq")
    return ops.sum(value * rows, "batch") / ops.sum(rows, "batch")


def _reference_logps(reference: Logits | None, params: Any, batch: dict, like: Named) -> tuple[Named, Named]:
    """The reference's chosen and rejected log-probabilities: the batch's precomputed ones
    (``ref_chosen_logps`` / ``ref_rejected_logps`` along each row, app/reference_logps.py) in
    ``like``'s dtype, else ``reference``'s forwards without gradient."""
    if "ref_chosen_logps" in batch:
        return tuple(ops.mean(batch[f"ref_{side}_logps"], "seq").astype(like.data.dtype)
                     for side in ("chosen", "rejected"))
    if reference is None:
        raise ValueError("the batch holds no precomputed reference log-probabilities (ref_chosen_logps) and no "
                         "reference model was given")
    with torch.no_grad():
        return tuple(sequence_logps(reference(params, batch[f"{side}_tokens"]), batch[f"{side}_labels"])[0]
                     for side in ("chosen", "rejected"))


def _wpo_weight(logits: Named, labels: Named) -> Named:
    """WPO's weight of each sequence (TRL's ``use_weighting``, without gradient): the exp of the
    mean over its labelled tokens of ``log p(token) - log sum_v p_v^2``, the vocabulary possibly
    split."""
    with torch.no_grad():
        logits = logits.map(lambda t: t.detach())
        token = ops.token_log_probs(logits, labels)
        wide = logits.astype(torch.float32) if logits.data.dtype in (torch.float16, torch.bfloat16) else logits
        log_sum_sq = ops.logsumexp(wide * 2, "vocab") - ops.logsumexp(wide, "vocab") * 2
        mask = labels.map(lambda t: (t != ops.IGNORE_INDEX).to(token.data.dtype))
        tokens = ops.sum(mask, "seq").map(lambda t: t.clamp(min=1))
        return (ops.sum((token - log_sum_sq.astype(token.data.dtype)) * mask, "seq") / tokens).map(torch.exp)


def _token_mean_nll(logps: Named, tokens: Named, weight: Named | None) -> Named:
    """TRL's DPO ``sft`` term: the chosen completions' NLL, a mean over the batch's completion
    tokens (the pairs weighted by ``pair_weight``: an evaluation's wrapped pairs count for nothing)."""
    if weight is not None:
        rows = ops.mean(weight, "seq")
        logps, tokens = logps * rows, tokens * rows
    return -ops.sum(logps, "batch") / ops.sum(tokens, "batch")


def _report(name: str, value: Named, weight: Named | None = None) -> None:
    """``value``'s mean over the batch (weighted by ``pair_weight``: an evaluation's wrapped
    pairs count for nothing) reported as the step's metric ``name``."""
    value = value.map(lambda t: t.detach().float())
    step_values.report(name, settle(_batch_mean(value, weight)).data)


def preference_loss(spec: PreferenceSpec, policy: Logits, reference: Logits | None = None
                    ) -> Callable[[Any, dict], Named]:
    """``loss(params, batch)`` of ``spec``: ``policy(params, tokens)`` gives the trained model's
    logits, ``reference(params, tokens)`` the frozen reference's (DPO / IPO; run without
    gradient; None: the batches carry the reference's log-probabilities, precomputed)."""
    if spec.method == "kto":
        if reference is None:
            raise ValueError("rl: kto compares with a reference model: give reference")
        return kto_loss(spec, policy, reference)

    def loss(params: Any, batch: dict) -> Named:
        chosen_logits = policy(params, batch["chosen_tokens"])
        chosen, n_chosen = sequence_logps(chosen_logits, batch["chosen_labels"])
        rejected_logits = policy(params, batch["rejected_tokens"])
        rejected, n_rejected = sequence_logps(rejected_logits, batch["rejected_labels"])
        if spec.needs_reference:
            ref_chosen, ref_rejected = _reference_logps(reference, params, batch, chosen)
            terms = L.dpo_loss_terms(spec.loss_type, spec.loss_weights)
            per_pair = [t for t, _ in terms if t != "sft"]
            per_pair_weights = [w for t, w in terms if t != "sft"]

            wpo = (_wpo_weight(chosen_logits, batch["chosen_labels"])
                   * _wpo_weight(rejected_logits, batch["rejected_labels"])
                   if spec.use_weighting else 1.0)

            def pair(*t):
                out = L.dpo_losses(*t[:4], beta=spec.beta, loss_type=per_pair, loss_weights=per_pair_weights,
                                   label_smoothing=spec.label_smoothing, discopop_tau=spec.discopop_tau,
                                   chosen_tokens=t[4], rejected_tokens=t[5])
                return out if len(t) < 7 else dataclasses.replace(out, losses=out.losses * t[6])
            operands, what = [chosen, rejected, ref_chosen, ref_rejected, n_chosen, n_rejected], "dpo"
            if spec.use_weighting:
                operands.append(wpo)
            sft = sum(w for t, w in terms if t == "sft")
            nll = _token_mean_nll(chosen, n_chosen, batch.get("pair_weight")) * sft if sft else None
            weight = None
        else:
            operands = [chosen / n_chosen.map(lambda t: t.clamp(min=1)),
                        rejected / n_rejected.map(lambda t: t.clamp(min=1))]
            if spec.method == "orpo":
                def pair(*t):
                    return L.orpo_losses(*t, beta=spec.beta)[0]
                weight = 1.0
            else:
                def pair(*t):
                    return L.cpo_losses(*t, beta=spec.beta, loss_type=spec.loss_type, simpo_gamma=spec.simpo_gamma,
                                        label_smoothing=spec.label_smoothing)
                weight = spec.cpo_alpha
            what = spec.method
            # the chosen sequences' NLL: ORPO's over prompt and completion, CPO's over the completion (TRL)
            nll_labels = batch["chosen_lm_labels" if spec.method == "orpo" else "chosen_labels"]
            nll = ops.cross_entropy(chosen_logits, nll_labels) * weight if weight else None
        out = _batch_mean(_per_sequence(lambda *t: pair(*t).losses, operands, what), batch.get("pair_weight"))
        if step_values.active():
            good = _per_sequence(lambda *t: pair(*t).chosen_rewards, operands, what)
            bad = _per_sequence(lambda *t: pair(*t).rejected_rewards, operands, what)
            w = batch.get("pair_weight")
            _report("rewards_chosen", good, w)
            _report("rewards_rejected", bad, w)
            _report("rewards_margins", good - bad, w)
            _report("rewards_accuracies", _per_sequence(lambda a, b: (a > b).float(), [good, bad], "accuracy"), w)
            _report("logps_chosen", operands[0] if not spec.needs_reference else chosen, w)
            _report("logps_rejected", operands[1] if not spec.needs_reference else rejected, w)
            if nll is not None and weight is not None:
                step_values.report("nll_loss", settle(nll).data.detach() / weight)
        return out if nll is None else out + nll
    return loss


def _mean_where(value: Named, weight: Named) -> Named:
    """The mean of ``value`` over the batch's rows where ``weight`` is 1 (0 where there are none)."""
    count = ops.sum(weight, "batch")
    return ops.sum(value * weight, "batch") / count.map(lambda t: t.clamp(min=1))


def kto_loss(spec: PreferenceSpec, policy: Logits, reference: Logits) -> Callable[[Any, dict], Named]:
    """KTO (TRL ``KTOTrainer``) over a batch of unpaired completions (``tokens`` / ``labels``,
    ``desirable``, the mismatched ``kl_tokens`` / ``kl_labels``; ``apo_zero_unpaired`` reads no KL rows):
    the KL estimate is the mean over the batch (every data-parallel rank's rows, as TRL gathers
    it over processes) of the policy's minus the reference's log-probability of the KL rows,
    without gradient, clamped at 0; each completion's loss is :func:`~.losses.kto_losses` of its
    log-ratio, weighted by ``desirable_weight`` / ``undesirable_weight``; the loss is their mean."""
    def loss(params: Any, batch: dict) -> Named:
        logps, _ = sequence_logps(policy(params, batch["tokens"]), batch["labels"])
        desirable = ops.mean(batch["desirable"], "seq")
        with torch.no_grad():
            ref, _ = sequence_logps(reference(params, batch["tokens"]), batch["labels"])
            if spec.kto_loss_type == "kto":
                kl_policy, _ = sequence_logps(policy(params, batch["kl_tokens"]), batch["kl_labels"])
                kl_ref, _ = sequence_logps(reference(params, batch["kl_tokens"]), batch["kl_labels"])
                kl = ops.mean(kl_policy - kl_ref, "batch")
            else:                                   # apo_zero_unpaired: no KL term (TRL logs kl 0)
                kl = ops.mean(logps.map(lambda t: torch.zeros_like(t.detach())), "batch")

        def per_example(lp, r, d, k):
            return L.kto_losses(lp, r, d > 0.5, k, beta=spec.beta, desirable_weight=spec.desirable_weight,
                                undesirable_weight=spec.undesirable_weight, loss_type=spec.kto_loss_type)
        out = ops.mean(_per_sequence(lambda *t: per_example(*t)[0], [logps, ref, desirable, kl], "kto"), "batch")
        if step_values.active():
            rewards = _per_sequence(lambda *t: per_example(*t)[1], [logps, ref, desirable, kl], "kto")
            undesirable = desirable.map(lambda t: 1 - t)
            good, bad = _mean_where(rewards, desirable), _mean_where(rewards, undesirable)
            step_values.report("kl", settle(kl).data.detach().clamp(min=0).float())
            for name, value in (("rewards_chosen", good), ("rewards_rejected", bad), ("rewards_margins", good - bad),
                                ("logps_chosen", _mean_where(logps.map(lambda t: t.detach()), desirable)),
                                ("logps_rejected", _mean_where(logps.map(lambda t: t.detach()), undesirable))):
                step_values.report(name, settle(value).data.detach().float())
        return out
    return loss
