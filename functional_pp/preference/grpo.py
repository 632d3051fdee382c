"""GRPO's advantages and loss as pure functions of rewards and per-token log-probabilities
(TRL 1.16 ``GRPOTrainer``: ``_generate_and_score_completions``'s group-normalised advantages,
``_compute_loss``'s clipped policy loss with the KL term), the rewards' combination
(:func:`combine_rewards`) and the objective over a model's logits for the training step
(:func:`grpo_objective`). The online loop that feeds them is :mod:`.rollout`
(docs/preference.md "GRPO").

Shapes: ``rewards`` / ``advantages`` ``[N]`` (a prompt's ``num_generations`` completions
consecutive), per-token tensors ``[N, T]`` over the completions' tokens, ``mask`` 1 on a
completion's tokens and 0 on its padding."""
from __future__ import annotations

import torch

__all__ = ["GRPO_LOSS_TYPES", "SCALE_REWARDS", "group_advantages", "combine_rewards", "grpo_token_losses",
           "grpo_loss", "grpo_objective"]

#: TRL's loss types built here (``loss_type``; TRL's default is ``dapo``)
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
#: TRL's ``scale_rewards``
SCALE_REWARDS = ("group", "batch", "none")


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN for one value)."""
    keep = dim is not None
    mean = torch.nanmean(x, dim=dim, keepdim=keep) if keep else torch.nanmean(x)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keep) if keep else (~torch.isnan(x)).sum()
    var = (torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keep) if keep else torch.nanmean((x - mean) ** 2))
    var = var * torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(var, float("nan")))
    std = var.sqrt()
    return std.squeeze(dim) if keep else std


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Each completion's reward less its group's mean (the group: one prompt's
    ``num_generations`` completions), divided by the group's standard deviation + 1e-4
    (``scale_rewards: group``), the batch's (``batch``) or not at all (``none``); a NaN reward
    (no reward function scored it) is left out of the means and gets advantage 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards == "group":
        std = (_nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1
               else torch.zeros_like(rewards))
        advantages = advantages / (std + 1e-4)
    elif scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                    scale_rewards: str = "group", aggregation: str = "sum_then_normalize"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards, advantages, std is zero)`` from each completion's rewards per function
    (``[N, F]``, NaN where a function gave None), as TRL's ``_generate_and_score_completions``:
    ``sum_then_normalize`` the weighted NaN-ignoring sum, then :func:`group_advantages`;
    ``normalize_then_sum`` (GDPO) each function's rewards normalised within the group, the
    weighted sum normalised over the batch. A completion no function scored is NaN (left out of
    the means) and gets advantage 0. ``rewards`` is the weighted sum (the logged reward)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = float("nan")
    if aggregation == "sum_then_normalize":
        advantages = group_advantages(rewards, num_generations, scale_rewards)
        if scale_rewards == "batch":
            std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            std = _nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
        mean = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = torch.stack([_nanstd(grouped[..., k], dim=1) for k in range(grouped.size(-1))], -1).unsqueeze(1)
        summed = (((grouped - mean) / (std_k + 1e-4)).view(-1, rewards_per_func.size(1)) * weights).nansum(dim=1)
        summed[unscorable] = float("nan")
        std = _nanstd(summed).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
        advantages = torch.nan_to_num((summed - torch.nanmean(summed)) / (std + 1e-4), nan=0.0)
    else:
        raise ValueError(f"multi_objective_aggregation {aggregation!r} is not sum_then_normalize or "
                         f"normalize_then_sum")
    return rewards, advantages, torch.isclose(std, torch.zeros_like(std))


def grpo_token_losses(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                      old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                      beta: float = 0.0, epsilon: float = 0.2, epsilon_high: float | None = None,
                      delta: float | None = None, importance_sampling_level: str = "token"
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-token loss ``-min(c A, clip(c, 1 - eps, 1 + eps_high) A)`` (``c`` the importance
    ratio against ``old_logps``, the policy's own when None; per token, or per sequence as the
    exp of the mean log-ratio; ``delta`` caps the unclipped ratio) plus ``beta`` times the KL
    estimate ``exp(ref - logp) - (ref - logp) - 1``. Returns ``(per-token loss, per-token KL or
    None)``."""
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level {importance_sampling_level!r} is not token or sequence")
    if beta and ref_logps is None:
        raise ValueError(f"beta={beta} weighs the KL to the reference: give ref_logps")
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if importance_sampling_level == "sequence":
        mask_f = mask.to(log_ratio.dtype)
        log_ratio = ((log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef = torch.exp(log_ratio)
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(coef, 1 - epsilon, 1 + high)
    if delta is not None:
        coef = torch.clamp(coef, max=delta)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    losses = -torch.min(coef * adv, clipped * adv)
    kl = None
    if beta:
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        losses = losses + beta * kl
    return losses, kl


def grpo_loss(token_losses: torch.Tensor, mask: torch.Tensor, loss_type: str = "dapo", *,
              max_completion_length: int | None = None, num_items: torch.Tensor | float | None = None
              ) -> torch.Tensor:
    """The per-token losses aggregated as TRL's ``loss_type``: ``grpo`` each completion's mean
    then their mean; ``bnpo`` the mean over all completion tokens; ``dr_grpo`` the sum over
    ``rows * max_completion_length``; ``dapo`` the sum over ``num_items`` (the completion tokens
    of the whole generation batch; default: this batch's)."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo loss_type {loss_type!r} is not one of {', '.join(GRPO_LOSS_TYPES)}")
    m = mask.to(token_losses.dtype)
    masked = token_losses * m
    if loss_type == "grpo":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("grpo loss_type 'dr_grpo' divides by max_completion_length: give it")
        return masked.sum() / (token_losses.size(0) * max_completion_length)
    total = m.sum() if num_items is None else torch.as_tensor(num_items, dtype=m.dtype)
    return masked.sum() / total.clamp(min=1.0)


def grpo_objective(policy, *, loss_type: str = "dapo", beta: float = 0.0, epsilon: float = 0.2,
                   epsilon_high: float | None = None, delta: float | None = None,
                   max_completion_length: int | None = None, reference=None):
    """``loss(params, batch)`` of GRPO for the training step, over a batch of sampled completions:
    ``tokens`` (prompt + completion, padded), ``labels`` (the completion's next tokens, -100
    elsewhere), ``advantages`` (each row's advantage along the row), optionally ``old_logps``
    (the sampling policy's per-token log-probabilities at the labels' positions; default the
    policy's own, detached: one update per batch). ``policy(params, tokens)`` gives the logits,
    ``reference(params, tokens)`` the reference's when ``beta`` > 0; optionally ``step_rows`` and
    ``step_tokens`` (the whole step's rows and completion tokens along each row: with gradient
    accumulation ``grpo`` and ``dr_grpo`` then weigh the step's rows alike, the step weighing each
    micro-batch by its share of the tokens). Token-level importance
    sampling; :func:`grpo_token_losses` per token, aggregated as :func:`grpo_loss` over the
    whole batch (every data-parallel rank's rows), named arrays throughout so that every layout
    computes the one-device loss."""
    from functional_pp import ops
    from functional_pp.core import step_values
    from functional_pp.ops.elementwise import broadcast

    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo loss_type {loss_type!r} is not one of {', '.join(GRPO_LOSS_TYPES)}")
    if beta and reference is None:
        raise ValueError(f"beta={beta} weighs the KL to the reference: give reference")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("grpo loss_type 'dr_grpo' divides by max_completion_length: give it")

    def loss(params, batch):
        labels = batch["labels"]
        logps = ops.token_log_probs(policy(params, batch["tokens"]), labels)
        mask = labels.map(lambda t: (t != ops.IGNORE_INDEX).to(logps.data.dtype))
        operands = [logps, batch["advantages"], mask, batch.get("old_logps")]
        if beta:
            with torch.no_grad():
                operands.append(ops.token_log_probs(reference(params, batch["tokens"]), labels))

        def per_token(lp, adv, m, old=None, ref=None):
            out = grpo_token_losses(lp, adv.to(lp.dtype), m, old_logps=old, ref_logps=ref, beta=beta,
                                    epsilon=epsilon, epsilon_high=epsilon_high, delta=delta)[0]
            return out * m
        if operands[3] is None:
            operands = [operands[0], operands[1], operands[2], *operands[4:]]

            def fn(lp, adv, m, *ref):
                return per_token(lp, adv, m, None, *ref)
        else:
            fn = per_token
        masked = broadcast(fn, operands, "grpo")
        if step_values.active():
            _report_token_means(operands, mask, beta, epsilon, epsilon_high, batch.get("old_logps") is not None)
        count = ops.sum(ops.sum(mask, "seq"), "batch")
        rows, scale = float(labels.size("batch")), 1.0
        if "step_rows" in batch and loss_type in ("grpo", "dr_grpo"):
            # a micro-batch of an accumulated step: the step weighs it by its share of the step's
            # completion tokens (step/train.py); these losses weigh rows, over the step's rows
            rows = _constant(batch["step_rows"])
            scale = _constant(batch["step_tokens"]) / count.map(lambda t: t.clamp(min=1.0))
        if loss_type == "grpo":
            per_row = ops.sum(masked, "seq") / ops.sum(mask, "seq").map(lambda t: t.clamp(min=1.0))
            return ops.sum(per_row, "batch") / rows * scale
        total = ops.sum(ops.sum(masked, "seq"), "batch")
        if loss_type == "dr_grpo":
            return total / (rows * max_completion_length) * scale
        return total / count.map(lambda t: t.clamp(min=1.0))
    return loss


def _constant(column):
    """The value a ``batch seq`` column holds everywhere (a scalar)."""
    from functional_pp import ops
    return ops.mean(ops.mean(column, "seq"), "batch")


def _report_token_means(operands: list, mask, beta: float, epsilon: float, epsilon_high: float | None,
                        has_old: bool) -> None:
    """TRL's logged ``kl`` (with ``beta``) and ``clip_ratio`` (``low_mean``, ``high_mean``,
    ``region_mean``): means over every completion token of the batch, to the step's metrics."""
    from functional_pp import ops
    from functional_pp.core import step_values
    from functional_pp.ops.elementwise import broadcast
    from functional_pp.parallel.named import settle
    lp, adv = operands[0].map(lambda t: t.detach()), operands[1]
    old = operands[3] if has_old else lp
    count = ops.sum(ops.sum(mask, "seq"), "batch").map(lambda t: t.clamp(min=1.0))

    def mean(fn, xs, name):
        return settle(ops.sum(ops.sum(broadcast(fn, xs, name), "seq"), "batch") / count).data.detach().float()
    if beta:
        ref = operands[-1]
        step_values.report("kl", mean(lambda p, r, m: (torch.exp(r - p) - (r - p) - 1) * m, [lp, ref, mask], "kl"))
    high = epsilon if epsilon_high is None else epsilon_high

    def low_clip(p, o, a, m):
        return ((torch.exp(p - o) < 1 - epsilon) & (a < 0)).to(m.dtype) * m

    def high_clip(p, o, a, m):
        return ((torch.exp(p - o) > 1 + high) & (a > 0)).to(m.dtype) * m
    lo = mean(low_clip, [lp, old, adv, mask], "clip")
    hi = mean(high_clip, [lp, old, adv, mask], "clip")
    step_values.report("clip_ratio_low_mean", lo)
    step_values.report("clip_ratio_high_mean", hi)
    step_values.report("clip_ratio_region_mean", lo + hi)
