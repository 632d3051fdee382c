"""TRL's own loss code run on given per-token log-probabilities: trainer objects built without
their ``__init__`` (no model, dataset or accelerator), holding only what the loss methods read,
and a stand-in model whose per-token log-probabilities are ``-softplus(weights[token])`` (so the
gradient with respect to ``weights`` can be compared too)."""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

trl = pytest.importorskip("trl")


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def token_logps(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The stand-in model's log-probability of each token of ``ids``."""
    return -F.softplus(weights[ids])


class TableModel:
    """Called like a TRL-patched model (``fused_lm_head=True``): ``log_probs`` of the labels."""

    training = True

    def __init__(self, weights: torch.Tensor):
        self.weights = weights

    def __call__(self, input_ids, labels, **_):
        shifted = labels[:, 1:]
        lp = torch.where(shifted != -100, token_logps(self.weights, input_ids[:, 1:]), 0.0)
        zeros = torch.zeros_like(lp)
        return SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def _shell(cls, **attrs):
    obj = cls.__new__(cls)
    obj.__dict__.update(accelerator=_Accelerator(), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                        _total_train_tokens=0, _tp_size=1, aux_loss_enabled=False, **attrs)
    return obj


def dpo_loss(model: TableModel, input_ids, completion_mask, ref_chosen, ref_rejected, *, beta, loss_type,
             label_smoothing=0.0, loss_weights=None, discopop_tau=0.05, use_weighting=False):
    """TRL ``DPOTrainer._compute_loss`` (reference log-probs precomputed) and its logged metrics;
    ``input_ids`` are the chosen rows, then the rejected ones; ``loss_type`` one or a list."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    t = _shell(trl.DPOTrainer, model=model, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
               loss_types=types, loss_weights=list(loss_weights or [1.0] * len(types)), beta=beta,
               label_smoothing=label_smoothing, use_weighting=use_weighting,
               args=SimpleNamespace(discopop_tau=discopop_tau))
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = t._compute_loss(model, inputs, False)
    return loss, _logged(t)


def _logged(trainer) -> dict:
    """The metrics the trainer logged for this batch (its train or eval dict, by the model's mode)."""
    found = trainer._metrics["train"] or trainer._metrics["eval"]
    return {k: v[-1] for k, v in found.items()}


def kto_loss(model: TableModel, input_ids, completion_mask, labels, ref_logps, kl_ids, kl_mask, ref_kl_logps, *,
             beta, desirable_weight=1.0, undesirable_weight=1.0, loss_type="kto"):
    """TRL ``KTOTrainer._compute_loss`` (reference log-probs precomputed; the KL term on for
    ``loss_type='kto'``, off for ``apo_zero_unpaired``, as TRL sets it)."""
    t = _shell(trl.KTOTrainer, model=model, precompute_ref_logps=True, calculate_KL=loss_type == "kto",
               loss_type=loss_type,
               beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "completion_mask": completion_mask, "label": labels, "ref_logps": ref_logps,
              "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(kl_ids), "KL_completion_mask": kl_mask,
              "ref_KL_logps": ref_kl_logps}
    loss = t._compute_loss(model, inputs, False)
    return loss, _logged(t)


def orpo_odds_ratio(chosen_mean, rejected_mean, *, beta):
    from trl.experimental.orpo import ORPOTrainer
    return ORPOTrainer.odds_ratio_loss(_shell(ORPOTrainer, beta=beta), chosen_mean, rejected_mean)


def cpo_loss(chosen, rejected, *, beta, loss_type, simpo_gamma=0.5, label_smoothing=0.0):
    from trl.experimental.cpo import CPOTrainer
    t = _shell(CPOTrainer, beta=beta, loss_type=loss_type, simpo_gamma=simpo_gamma,
               label_smoothing=label_smoothing, alpha=0.0)
    return CPOTrainer.cpo_loss(t, chosen, rejected)


def pair_trainer_loss(method: str, model, batch: dict, *, beta: float, simpo_gamma: float = 0.5,
                      cpo_alpha: float = 1.0):
    """TRL ``ORPOTrainer`` (``method`` orpo) or ``CPOTrainer`` with ``loss_type='simpo'``:
    ``get_batch_loss_metrics`` of a tokenized pair batch (TRL's ``chosen_input_ids``,
    ``chosen_attention_mask``, ``chosen_labels``, ...) on a transformers model; the loss and the
    logged metrics."""
    if method == "orpo":
        from trl.experimental.orpo import ORPOTrainer as cls
        extra = {}
    else:
        from trl.experimental.cpo import CPOTrainer as cls
        extra = dict(loss_type="simpo", simpo_gamma=simpo_gamma, cpo_alpha=cpo_alpha, alpha=0.0, label_smoothing=0.0)
    t = _shell(cls, beta=beta, is_encoder_decoder=False, padding_value=0, pad_token_id=0, label_pad_token_id=-100,
               **extra)
    return cls.get_batch_loss_metrics(t, model, batch)


def grpo_loss(logps, completion_mask, advantages, *, old_logps=None, ref_logps=None, beta=0.0, loss_type="dapo",
              epsilon=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
              max_completion_length=None, accumulation=1, processes=1, num_items=None, entropies=None):
    """TRL ``GRPOTrainer._compute_loss`` on given per-token log-probabilities of the completions
    (the model's forward replaced by them) and the batch's advantages; the loss and the logged
    metrics. With ``accumulation`` / ``processes``: one micro-batch of one process of such a
    step (``steps_per_generation`` = ``accumulation``, TRL's default), ``num_items`` the
    generation batch's completion tokens (every process's)."""
    t = _shell(trl.GRPOTrainer, model=SimpleNamespace(training=True), top_entropy_quantile=1.0,
               off_policy_mask_threshold=None, importance_sampling_level=importance_sampling_level, beta=beta,
               loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
               use_vllm=False, vllm_importance_sampling_correction=False,
               current_gradient_accumulation_steps=accumulation,
               max_completion_length=max_completion_length, _entropy_bonus_enabled=False,
               args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=accumulation))
    t.accelerator.num_processes = processes
    t.accelerator.reduce = lambda x, reduction="sum": x
    ent = torch.zeros_like(logps) if entropies is None else entropies
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, ent, None)
    n = logps.size(0)
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(completion_mask), "completion_mask": completion_mask,
              "advantages": advantages,
              "num_items_in_batch": completion_mask.sum() if num_items is None else torch.as_tensor(num_items)}
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    return trl.GRPOTrainer._compute_loss(t, None, inputs), _logged(t)
