"""GRPO's online half (docs/preference.md "GRPO"), as TRL 1.16's ``GRPOTrainer``
``_generate_and_score_completions`` does it, in pieces that compose:

1. :func:`sample_completions`: ``num_generations`` completions per prompt, sampled with the
   policy's current parameters by :func:`functional_pp.models.sampling.generate` (in-process,
   under the run's layout; one left-padded call, each row its own seed); each completion ends
   at its first stop token (kept) or at ``max_completion_length`` (truncated);
2. :func:`score`: the reward functions, TRL's signature ``f(prompts, completions,
   completion_ids, **columns) -> list[float | None]`` (the dataset's other columns as keyword
   arguments, one value per completion), ``[N, F]`` with NaN for None;
3. :func:`~functional_pp.preference.grpo.combine_rewards`: the weighted rewards and the
   group-normalised advantages;
4. :func:`rollout_batch`: the training batch (``tokens``: prompt + completion padded to
   ``seq_len``; ``labels``: the completion's tokens at the positions predicting them;
   ``advantages`` along each row) for :func:`~functional_pp.preference.grpo.grpo_objective`.

:func:`rollout` runs 1-3 and :func:`rollout_metrics` gives TRL's logged values (``/`` as ``_``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from functional_pp.models.sampling import generate, left_padded
from functional_pp.preference.grpo import _nanstd, combine_rewards

__all__ = ["Rollout", "params_device", "sample_completions", "call_rows", "decode_completions", "score", "rollout",
           "rollout_batch", "rollout_metrics", "generation_seed"]


def generation_seed(key: int, step: int, row: int = 0, stream: int = 0) -> int:
    """The sampling seed of a step's ``row``-th sampled row (prompt ``row // num_generations``),
    from the run's generation key (``stream`` > 0: the step's evaluation batch ``stream - 1``,
    apart from the training samples): a row draws the same tokens however the rows are batched."""
    entropy = [int(key), int(step), int(row)] + ([int(stream)] if stream else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def params_device(params: Any) -> torch.device:
    """Where the parameters are (the prompts' token ids go there)."""
    from functional_pp.core.tree import tree_leaves
    leaf = tree_leaves(params)[0]
    return getattr(leaf, "data", leaf).device


def sample_completions(forward: Callable, params: Any, prompt_ids: Sequence[Sequence[int]], *, num_generations: int,
                       max_completion_length: int, stop_ids: Sequence[int], pad_id: int, temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0, key: int = 0, step: int = 0, row_multiple: int = 1,
                       stream: int = 0, max_call_tokens: int | None = None) -> tuple[list[list[int]], list[bool]]:
    """``(completions, truncated)``, ``num_generations`` consecutive rows per prompt: each the
    sampled tokens up to and including the first of ``stop_ids`` (not truncated), or
    ``max_completion_length`` tokens without one (truncated). The rows are sampled in one
    :func:`generate` call, the prompts left-padded with ``pad_id`` to the longest (an attention
    mask: the padding is never attended, each row's positions start at its first token), rows
    padded to a multiple of ``row_multiple`` by repeating the last (the data-parallel size);
    with ``max_call_tokens`` in as few calls as keep each call's padded rows x (longest prompt +
    ``max_completion_length``) within it (its key / value cache), the rows taken shortest prompt
    first. Row ``i`` draws from its own seed :func:`generation_seed` of ``key``, ``step``, ``i``
    and ``stream``, so its tokens are those it gets sampled alone, however the rows are batched."""
    rows = [list(p) for p in prompt_ids for _ in range(num_generations)]
    seeds = [generation_seed(key, step, i, stream) for i in range(len(rows))]
    out: list[list[int]] = [[] for _ in rows]
    truncated = [False] * len(rows)
    stops = set(int(s) for s in stop_ids)
    device = params_device(params) if rows else None
    for which in call_rows([len(r) for r in rows], max_completion_length, row_multiple, max_call_tokens):
        extra = -len(which) % max(1, row_multiple)
        which_padded = which + [which[-1]] * extra
        tokens, mask = left_padded([rows[i] for i in which_padded], pad_id)
        new = generate(forward, params, tokens.to(device), attention_mask=mask.to(device),
                       max_new_tokens=max_completion_length, eos_id=list(stop_ids) or None, pad_id=pad_id,
                       temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=[seeds[i] for i in which_padded])[:len(which), tokens.size(1):].cpu()
        for i, row in zip(which, new.tolist()):
            end = next((k for k, t in enumerate(row) if t in stops), None)
            out[i] = row if end is None else row[:end + 1]
            truncated[i] = end is None
    return out, truncated


def call_rows(lengths: Sequence[int], new_tokens: int, row_multiple: int = 1,
              max_call_tokens: int | None = None) -> list[list[int]]:
    """The rows (indices into ``lengths``, the prompts' lengths) of each generate call: all in
    one (``max_call_tokens`` None), else shortest prompt first, a call growing while its rows
    (padded to a multiple of ``row_multiple``) x (its longest prompt + ``new_tokens``) stay within
    ``max_call_tokens`` (a row alone over it: a call of its own)."""
    if not lengths:
        return []
    if max_call_tokens is None:
        return [list(range(len(lengths)))]
    calls: list[list[int]] = [[]]
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        rows = -(-(len(calls[-1]) + 1) // max(1, row_multiple)) * max(1, row_multiple)
        if calls[-1] and rows * (lengths[i] + new_tokens) > max_call_tokens:
            calls.append([])
        calls[-1].append(i)
    return calls


def decode_completions(tokenizer: Any, completion_ids: Sequence[Sequence[int]], conversational: bool) -> list:
    """The completions as reward functions see them (TRL): decoded without special tokens; for
    conversational prompts ``[{"role": "assistant", "content": text}]``."""
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


def score(reward_funcs: Sequence[tuple[str, Callable]], prompts: list, completions: list,
          completion_ids: list, columns: dict) -> torch.Tensor:
    """``[N, F]`` rewards (float32; NaN where a function returned None): each function called
    once with every completion (TRL's signature); a wrong count or value names the function."""
    out = torch.full((len(completions), len(reward_funcs)), float("nan"), dtype=torch.float32)
    for k, (name, fn) in enumerate(reward_funcs):
        try:
            got = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:      # noqa: BLE001 (the user's code: say which function failed)
            raise RuntimeError(f"reward function {name} raised {type(exc).__name__}: {exc} (it is called as "
                               f"f(prompts=..., completions=..., completion_ids=..., "
                               f"{', '.join(f'{k}=...' for k in columns) or '**columns'}))") from exc
        got = list(got) if got is not None else []
        if len(got) != len(completions):
            raise ValueError(f"reward function {name} returned {len(got)} rewards for {len(completions)} "
                             f"completions; return one float (or None) per completion")
        for i, v in enumerate(got):
            if v is None:
                continue
            try:
                out[i, k] = float(v)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"reward function {name} returned {v!r} for completion {i}: not a number "
                                 f"(return floats, or None where it does not apply)") from exc
    return out


@dataclass
class Rollout:
    """One step's sampled completions, their rewards and advantages (``num_generations``
    consecutive rows per prompt)."""

    prompt_ids: list[list[int]]          # per completion
    completion_ids: list[list[int]]
    truncated: list[bool]
    rewards_per_func: torch.Tensor       # [N, F]
    rewards: torch.Tensor                # [N], the weighted sum (NaN: unscored)
    advantages: torch.Tensor             # [N]
    std_is_zero: torch.Tensor            # [N]
    reward_names: list[str]


def rollout(forward: Callable, params: Any, prompts: Sequence[Any], spec: Any, tokenizer: Any,
            reward_funcs: Sequence[tuple[str, Callable]], *, stop_ids: Sequence[int], pad_id: int, key: int,
            step: int, row_multiple: int = 1, reward_kwargs: dict | None = None, stream: int = 0) -> Rollout:
    """Sample, score and normalise one step's completions of ``prompts``
    (:class:`~functional_pp.data.prompts.Prompt`) with ``spec``'s
    (:class:`~functional_pp.preference.grpo_spec.GRPOSpec`) settings; ``reward_kwargs`` go to
    every reward function besides the dataset's columns (TRL's ``trainer_state``, ``log_metric``);
    ``stream`` picks the seeds (:func:`generation_seed`: 0 training, > 0 evaluation)."""
    g = spec.num_generations
    completion_ids, truncated = sample_completions(
        forward, params, [p.ids for p in prompts], num_generations=g,
        max_completion_length=spec.max_completion_length, stop_ids=stop_ids, pad_id=pad_id,
        temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, key=key, step=step,
        row_multiple=row_multiple, stream=stream)
    raw = [p.raw for p in prompts for _ in range(g)]
    conversational = not isinstance(raw[0], str)
    names = sorted({k for p in prompts for k in p.columns})
    columns = {k: [p.columns.get(k) for p in prompts for _ in range(g)] for k in names}
    completions = decode_completions(tokenizer, completion_ids, conversational)
    per_func = score(reward_funcs, raw, completions, completion_ids, {**columns, **(reward_kwargs or {})})
    weights = torch.tensor(spec.weights(), dtype=torch.float32)
    rewards, advantages, zero = combine_rewards(per_func, weights, g, spec.scale_rewards,
                                                spec.multi_objective_aggregation)
    return Rollout([list(p.ids) for p in prompts for _ in range(g)], completion_ids, truncated, per_func,
                   rewards, advantages, zero, [n for n, _ in reward_funcs])


def rollout_batch(r: Rollout, seq_len: int, pad_id: int, mask_truncated: bool = False,
                  chunk_rows: int | None = None) -> dict[str, torch.Tensor]:
    """The global training batch of ``r``: ``tokens`` ``[N, seq_len]`` (prompt, completion, then
    ``pad_id``), ``labels`` (each completion token at the position predicting it, -100 elsewhere;
    a truncated completion's all -100 with ``mask_truncated``), ``advantages`` along each row,
    ``step_rows`` / ``step_tokens`` (the batch's rows and completion tokens, along each row: how
    :func:`~functional_pp.preference.grpo.grpo_objective` weighs accumulated micro-batches) and,
    with ``chunk_rows`` (TRL's ``per_device_train_batch_size``: the run's ``micro_batch_size``),
    ``chunk_tokens`` (the completion tokens of the row's block of ``chunk_rows`` consecutive
    rows, TRL's micro-batch of one process) and ``step_chunks`` (the blocks): ``bnpo``'s
    normalisers."""
    n = len(r.completion_ids)
    tokens = torch.full((n, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n, seq_len), -100, dtype=torch.long)
    for i, (p, c) in enumerate(zip(r.prompt_ids, r.completion_ids)):
        if len(p) + len(c) > seq_len:
            raise ValueError(f"prompt ({len(p)}) + completion ({len(c)}) tokens exceed sequence_len {seq_len}")
        tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        if not (mask_truncated and r.truncated[i]):
            labels[i, len(p) - 1:len(p) - 1 + len(c)] = torch.tensor(c)
    advantages = r.advantages.to(torch.float32)[:, None].expand(n, seq_len).contiguous()
    per_row = (labels != -100).sum(-1).to(torch.float32)
    out = {"tokens": tokens, "labels": labels, "advantages": advantages,
           "step_rows": torch.full((n, seq_len), float(n)),
           "step_tokens": torch.full((n, seq_len), float(per_row.sum()))}
    if chunk_rows is not None:
        if chunk_rows < 1 or n % chunk_rows:
            raise ValueError(f"{n} completions do not split into micro-batches of {chunk_rows}")
        chunk = per_row.view(-1, chunk_rows).sum(-1).repeat_interleave(chunk_rows)
        out["chunk_tokens"] = chunk[:, None].expand(n, seq_len).contiguous()
        out["step_chunks"] = torch.full((n, seq_len), float(n // chunk_rows))
    return out


def rollout_metrics(r: Rollout) -> dict[str, float]:
    """TRL's logged generation metrics (``/`` written ``_``): ``reward``, ``reward_std``,
    ``rewards_<func>_mean`` / ``_std``, ``frac_reward_zero_std``, ``completions_mean_length`` /
    ``min_length`` / ``max_length``, ``completions_clipped_ratio`` (truncated), and the
    terminated completions' ``completions_mean_terminated_length`` / min / max."""
    lengths = torch.tensor([len(c) for c in r.completion_ids], dtype=torch.float32)
    cut = torch.tensor(r.truncated)
    done = lengths[~cut] if bool((~cut).any()) else torch.zeros(1)
    out = {"reward": float(torch.nanmean(r.rewards)), "reward_std": float(_nanstd(r.rewards)),
           "frac_reward_zero_std": float(r.std_is_zero.float().mean())}
    for k, name in enumerate(r.reward_names):
        out[f"rewards_{name}_mean"] = float(torch.nanmean(r.rewards_per_func[:, k]))
        out[f"rewards_{name}_std"] = float(_nanstd(r.rewards_per_func[:, k]))
    out.update({"completions_mean_length": float(lengths.mean()), "completions_min_length": float(lengths.min()),
                "completions_max_length": float(lengths.max()), "completions_clipped_ratio": float(cut.float().mean()),
                "completions_mean_terminated_length": float(done.mean()),
                "completions_min_terminated_length": float(done.min()),
                "completions_max_terminated_length": float(done.max())})
    return out
