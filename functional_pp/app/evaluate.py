"""Held-out loss on the training mesh: the step's loss function without gradients, over every
batch of the validation loader, weighted by each batch's number of labels, each held-out window
counted once (so the result is the mean token loss of the whole held-out set, whatever the
layout and the batch size). ``docs/finetune.md``. Preference pairs: weighted by each batch's
pairs (``pair_weight``), the mean pair loss of the held-out pairs, and TRL's evaluation metrics
(``eval_rewards_chosen``, ...: what the loss reports, each the mean over the held-out pairs;
docs/preference.md "Held-out pairs")."""
from __future__ import annotations

from typing import Any

import optree
import torch

from functional_pp.parallel.named import settle, wrap
from functional_pp.parallel.shard_map import use_rules
from functional_pp.step.train import TrainStep

__all__ = ["evaluate", "evaluate_metrics", "eval_batches", "perplexity", "perplexity_streams"]


def eval_batches(loader) -> int:
    """Batches that cover the held-out windows once (at least one)."""
    return max(1, -(-loader.num_windows // loader.global_batch_size))


def evaluate(step: TrainStep, state: dict, loader, n_batches: int | None = None) -> float:
    """Mean token loss of ``state``'s parameters over the first ``n_batches`` batches of
    ``loader`` (default: all its windows once). Runs on every device of the mesh."""
    return evaluate_metrics(step, state, loader, n_batches)["eval_loss"]


def evaluate_metrics(step: TrainStep, state: dict, loader, n_batches: int | None = None) -> dict[str, float]:
    """``{"eval_loss": ...}`` as :func:`evaluate`; for preference pairs also the values the loss
    reports (:mod:`functional_pp.core.step_values`: ``rewards_chosen``, ``rewards_rejected``,
    ``rewards_margins``, ``rewards_accuracies``, ``logps_chosen``, ``logps_rejected``, ORPO's /
    SimPO's ``nll_loss``), prefixed ``eval_``, each weighted by the batch's pairs as the loss is."""
    from functional_pp.core import step_values
    from functional_pp.ops import mean
    from functional_pp.ops import sum as nsum
    if step.spec is None:
        raise RuntimeError("evaluate: call step.init(params) first")
    n_batches = eval_batches(loader) if n_batches is None else n_batches
    leaves = optree.tree_leaves(state["params"], none_is_leaf=False)
    total, count = 0.0, 0.0
    reported: dict[str, float] = {}
    with torch.no_grad(), use_rules(step.rules), step.apply_policy():       # the step's ops, same policy
        params: Any = step.named_params(state["params"])
        device = leaves[0].device if leaves else None
        for i in range(n_batches):
            batch = loader.batch(i, each_window_once=True)      # (the wrapped last batch: no token twice)
            if device is not None:
                batch = {k: v.to(device) for k, v in batch.items()}
            nb = {k: wrap(v, step.batch_dims[k]) for k, v in batch.items()}
            pairs = "pair_weight" in batch
            with step_values.collecting() as found:
                loss = float(settle(step.loss_fn(params, nb)).data)
            if not pairs:
                valid = (batch["labels"] != -100).to(torch.float64)
                n = float(settle(nsum(wrap(valid, step.batch_dims["labels"]))).data)
            else:                             # preference pairs: each pair's weight (data/pair_loader.py)
                rows = mean(wrap(batch["pair_weight"].to(torch.float64), step.batch_dims["pair_weight"]), "seq")
                n = float(settle(nsum(rows)).data)
                for name, (value, _) in found.items():
                    if value.numel() == 1:
                        reported[name] = reported.get(name, 0.0) + float(value) * n
            total += loss * n
            count += n
    count = max(count, 1.0)
    return {"eval_loss": total / count, **{f"eval_{k}": v / count for k, v in reported.items()}}


def perplexity_streams(val, tokenizer, max_seq_len: int, seq_len: int) -> list:
    """Axolotl's perplexity windows of the held-out rows ``val`` (data/causal_lm_eval.py), each a
    ``(tokens, trained)`` stream of rows of ``seq_len`` tokens for a held-out loader."""
    from functional_pp.data.causal_lm_eval import perplexity_windows, reference_ids, references
    from functional_pp.data.tokenizer import HFTokenizer
    if not isinstance(tokenizer, HFTokenizer):
        raise ValueError("do_causal_lm_eval re-tokenizes the held-out references: it needs base_model's (or "
                         "tokenizer:) Hugging Face tokenizer")
    ids, pad_id = reference_ids(references(val, tokenizer), tokenizer)
    return [(w.tokens, w.trained) for w in perplexity_windows(ids, max_seq_len, seq_len, pad_id)]


def perplexity(step: TrainStep, state: dict, loaders: list) -> float:
    """``exp`` of the mean over Axolotl's perplexity windows (``loaders``: one held-out loader per
    window, :func:`perplexity_streams`) of each window's mean token loss: its ``Perplexity``
    metric (``eval_perplexity``). Runs on every device of the mesh."""
    import math
    losses = [evaluate(step, state, loader) for loader in loaders]
    return math.exp(sum(losses) / len(losses)) if losses else float("nan")
