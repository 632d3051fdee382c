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

__all__ = ["GRPO_LOSS_TYPES", "SCALE_REWARDS", "IMPORTANCE_SAMPLING_LEVELS", "group_advantages", "combine_rewards", "grpo_token_losses",
           "grpo_loss", "grpo_objective"]

#: TRL's loss types built here (``loss_type``; TRL's default is ``dapo``)
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
#: TRL's ``scale_rewards``
SCALE_REWARDS = ("group", "batch", "none")
#: TRL's ``importance_sampling_level`` (``sequence``: GSPO)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


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
                      delta: float | None = None, importance_sampling_level: str = "token",
                      log_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-token loss ``-min(c A, clip(c, 1 - eps, 1 + eps_high) A)`` (``c`` the importance
    ratio against ``old_logps``, the policy's own when None; per token, or per sequence (GSPO)
    as the exp of the mean log-ratio over the sequence's tokens; ``delta`` caps the unclipped
    ratio) plus ``beta`` times the KL estimate ``exp(ref - logp) - (ref - logp) - 1``.
    ``log_weights`` (``[N, 1]``), where given, is the log-ratio already (a sequence's mean
    computed elsewhere, e.g. over a sequence split across devices). Returns ``(per-token loss,
    per-token KL or None)``."""
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level {importance_sampling_level!r} is not token or sequence")
    if beta and ref_logps is None:
        raise ValueError(f"beta={beta} weighs the KL to the reference: give ref_logps")
    if log_weights is not None:
        log_ratio = log_weights
    else:
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
              max_completion_length: int | None = None, num_items: torch.Tensor | float | None = None,
              chunk_rows: int | None = None) -> torch.Tensor:
    """The per-token losses aggregated as TRL's ``loss_type``: ``grpo`` each completion's mean
    then their mean; ``bnpo`` the mean over the completion tokens of each micro-batch of
    ``chunk_rows`` consecutive rows (TRL's ``per_device_train_batch_size``; default: one), the
    micro-batches' means averaged (TRL: each process's micro-batch normalised by its own tokens,
    averaged over accumulation and processes); ``dr_grpo`` the sum over ``rows *
    max_completion_length``; ``dapo`` the sum over ``num_items`` (the completion tokens of the
    whole generation batch; default: this batch's)."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo loss_type {loss_type!r} is not one of {', '.join(GRPO_LOSS_TYPES)}")
    m = mask.to(token_losses.dtype)
    masked = token_losses * m
    if loss_type == "grpo":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        rows = token_losses.size(0) if chunk_rows is None else chunk_rows
        if rows < 1 or token_losses.size(0) % rows:
            raise ValueError(f"grpo loss_type 'bnpo': {token_losses.size(0)} rows do not split into micro-batches "
                             f"of {rows}")
        per_chunk = masked.sum(-1).view(-1, rows).sum(-1) / m.sum(-1).view(-1, rows).sum(-1).clamp(min=1.0)
        return per_chunk.mean()
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("grpo loss_type 'dr_grpo' divides by max_completion_length: give it")
        return masked.sum() / (token_losses.size(0) * max_completion_length)
    total = m.sum() if num_items is None else torch.as_tensor(num_items, dtype=m.dtype)
    return masked.sum() / total.clamp(min=1.0)


def grpo_objective(policy, *, loss_type: str = "dapo", beta: float = 0.0, epsilon: float = 0.2,
                   epsilon_high: float | None = None, delta: float | None = None,
                   max_completion_length: int | None = None, reference=None,
                   importance_sampling_level: str = "token"):
    """``loss(params, batch)`` of GRPO for the training step, over a batch of sampled completions:
    ``tokens`` (prompt + completion, padded), ``labels`` (the completion's next tokens, -100
    elsewhere), ``advantages`` (each row's advantage along the row), optionally ``old_logps``
    (the sampling policy's per-token log-probabilities at the labels' positions; default the
    policy's own, detached: one update per batch). ``policy(params, tokens)`` gives the logits,
    ``reference(params, tokens)`` the reference's when ``beta`` > 0. Optionally ``step_rows`` and
    ``step_tokens`` (the whole step's rows and completion tokens along each row: with gradient
    accumulation ``grpo``, ``bnpo`` and ``dr_grpo`` then weigh the step's rows as TRL does, the
    step weighing each micro-batch by its share of the tokens), and for ``bnpo``
    ``chunk_tokens`` / ``step_chunks`` (the completion tokens of the row's TRL micro-batch and
    the step's number of them: TRL normalises each micro-batch of each process by its own
    tokens; without them the batch is one). :func:`grpo_token_losses` per token (the ratio per
    token, or per sequence with ``importance_sampling_level="sequence"``: GSPO), aggregated as
    :func:`grpo_loss` over the whole batch (every data-parallel rank's rows), named arrays
    throughout so that every layout (a sequence split over cp included) computes the one-device
    loss."""
    from functional_pp import ops
    from functional_pp.core import step_values
    from functional_pp.ops.elementwise import broadcast
    from functional_pp.parallel.named import settle

    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo loss_type {loss_type!r} is not one of {', '.join(GRPO_LOSS_TYPES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level {importance_sampling_level!r} is not token or sequence")
    if beta and reference is None:
        raise ValueError(f"beta={beta} weighs the KL to the reference: give reference")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("grpo loss_type 'dr_grpo' divides by max_completion_length: give it")

    def clamp1(x):
        return x.map(lambda t: t.clamp(min=1.0))

    def loss(params, batch):
        labels = batch["labels"]
        logits = policy(params, batch["tokens"])
        logps = ops.token_log_probs(logits, labels)
        mask = labels.map(lambda t: (t != ops.IGNORE_INDEX).to(logps.data.dtype))
        x = {"lp": logps, "adv": batch["advantages"], "m": mask}
        if batch.get("old_logps") is not None:
            x["old"] = batch["old_logps"]
        if importance_sampling_level == "sequence":     # the mean log-ratio over each sequence (cp: summed over it)
            terms = [x["lp"], x["m"]] + ([x["old"]] if "old" in x else [])
            diff = broadcast(lambda p, m, *o: (p - (o[0] if o else p.detach())) * m, terms, "gspo")
            x["slr"] = ops.sum(diff, "seq") / clamp1(ops.sum(mask, "seq"))
        if beta:
            with torch.no_grad():
                x["ref"] = ops.token_log_probs(reference(params, batch["tokens"]), labels)
        names = list(x)

        def per_token(*blocks):
            b = dict(zip(names, blocks))
            out = grpo_token_losses(b["lp"], b["adv"].to(b["lp"].dtype), b["m"], old_logps=b.get("old"),
                                    ref_logps=b.get("ref"), beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
                                    delta=delta, log_weights=b.get("slr"))[0]
            return out * b["m"]
        masked = broadcast(per_token, list(x.values()), "grpo")
        if step_values.active():
            _report_token_means(x, beta, epsilon, epsilon_high)
            with torch.no_grad():               # TRL's entropy: the mean over the batch's completion tokens
                ent = ops.sum(ops.sum(token_entropy(logits) * mask, "seq"), "batch") / clamp1(
                    ops.sum(ops.sum(mask, "seq"), "batch"))
            step_values.report("entropy", settle(ent).data.detach().float())
        count = ops.sum(ops.sum(mask, "seq"), "batch")
        rows, scale = float(labels.size("batch")), 1.0
        if "step_rows" in batch and loss_type != "dapo":
            # a micro-batch of an accumulated step: the step weighs it by its share of the step's
            # completion tokens (step/train.py); these losses weigh rows, over the step's rows
            rows = _constant(batch["step_rows"])
            scale = _constant(batch["step_tokens"]) / clamp1(count)
        if loss_type == "grpo":
            per_row = ops.sum(masked, "seq") / clamp1(ops.sum(mask, "seq"))
            return ops.sum(per_row, "batch") / rows * scale
        if loss_type == "bnpo" and "chunk_tokens" in batch:
            # TRL: each micro-batch of each process over its own tokens, their mean
            per_row = ops.sum(masked, "seq") / clamp1(ops.mean(batch["chunk_tokens"], "seq"))
            return ops.sum(per_row, "batch") / _constant(batch["step_chunks"]) * scale
        total = ops.sum(ops.sum(masked, "seq"), "batch")
        if loss_type == "dr_grpo":
            return total / (rows * max_completion_length) * scale
        return total / clamp1(count)
    return loss


def token_entropy(logits):
    """Each position's entropy of the softmax of ``logits`` (named ``... vocab``; the vocabulary
    possibly split), without gradient: ``logsumexp(x) - sum softmax(x) x``."""
    from functional_pp import ops
    with torch.no_grad():
        x = logits.map(lambda t: t.detach())
        x = x.astype(torch.float32) if x.data.dtype in (torch.float16, torch.bfloat16) else x
        lse = ops.logsumexp(x, "vocab")
        return lse - ops.sum((x - lse).map(torch.exp) * x, "vocab")


def _constant(column):
    """The value a ``batch seq`` column holds everywhere (a scalar)."""
    from functional_pp import ops
    return ops.mean(ops.mean(column, "seq"), "batch")


def _report_token_means(x: dict, beta: float, epsilon: float, epsilon_high: float | None) -> None:
    """TRL's logged ``kl`` (with ``beta``) and ``clip_ratio`` (``low_mean``, ``high_mean``,
    ``region_mean``: means over every completion token of the batch, or over its sequences
    with sequence-level ratios; ``low_min`` / ``high_max``: the smallest / largest of the
    sequences' clipped shares), to the step's metrics."""
    from functional_pp import ops
    from functional_pp.core import step_values
    from functional_pp.ops.elementwise import broadcast
    from functional_pp.parallel.named import settle
    mask = x["m"]
    lp, adv = x["lp"].map(lambda t: t.detach()), x["adv"]
    count = ops.sum(ops.sum(mask, "seq"), "batch").map(lambda t: t.clamp(min=1.0))

    def value(v):
        return settle(v).data.detach().float()

    def mean(fn, xs, name):
        return value(ops.sum(ops.sum(broadcast(fn, xs, name), "seq"), "batch") / count)
    if beta:
        step_values.report("kl", mean(lambda p, r, m: (torch.exp(r - p) - (r - p) - 1) * m, [lp, x["ref"], mask], "kl"))
    high = epsilon if epsilon_high is None else epsilon_high
    if "slr" in x:                        # one ratio per sequence: means over the sequences
        slr = x["slr"].map(lambda t: t.detach())
        adv_row = ops.mean(adv, "seq")
        lo_rows = broadcast(lambda s, a: ((torch.exp(s) < 1 - epsilon) & (a < 0)).to(s.dtype), [slr, adv_row], "clip")
        hi_rows = broadcast(lambda s, a: ((torch.exp(s) > 1 + high) & (a > 0)).to(s.dtype), [slr, adv_row], "clip")
        lo, hi = value(ops.mean(lo_rows, "batch")), value(ops.mean(hi_rows, "batch"))
    else:
        old = x.get("old", lp)

        def low_clip(p, o, a, m):
            return ((torch.exp(p - o) < 1 - epsilon) & (a < 0)).to(m.dtype) * m

        def high_clip(p, o, a, m):
            return ((torch.exp(p - o) > 1 + high) & (a > 0)).to(m.dtype) * m
        lo_tok, hi_tok = broadcast(low_clip, [lp, old, adv, mask], "clip"), broadcast(high_clip, [lp, old, adv, mask],
                                                                                    "clip")
        lo = value(ops.sum(ops.sum(lo_tok, "seq"), "batch") / count)
        hi = value(ops.sum(ops.sum(hi_tok, "seq"), "batch") / count)
        # TRL's per-sequence shares (0 / 0 for a row without tokens: NaN, left out of min / max)
        tokens = ops.sum(mask, "seq")
        lo_rows = ops.sum(lo_tok, "seq") / tokens
        hi_rows = ops.sum(hi_tok, "seq") / tokens
    step_values.report("clip_ratio_low_mean", lo)
    step_values.report("clip_ratio_high_mean", hi)
    step_values.report("clip_ratio_region_mean", lo + hi)
    low_min = value(ops.min(lo_rows.map(lambda t: torch.nan_to_num(t, nan=2.0)), "batch"))
    high_max = value(ops.max(hi_rows.map(lambda t: torch.nan_to_num(t, nan=-1.0)), "batch"))
    step_values.report("clip_ratio_low_min", torch.where(low_min > 1, float("nan"), low_min))
    step_values.report("clip_ratio_high_max", torch.where(high_max < 0, float("nan"), high_max))
