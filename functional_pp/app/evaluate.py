"""Held-out loss on the training mesh: the step's loss function without gradients, over every
batch of the validation loader, weighted by each batch's number of labels, each held-out window
counted once (so the result is the mean token loss of the whole held-out set, whatever the
layout and the batch size). ``docs/finetune.md``. Preference pairs: weighted by each batch's
pairs (``pair_weight``), the mean pair loss of the held-out pairs (docs/preference.md)."""
from __future__ import annotations

from typing import Any

import optree
import torch

from functional_pp.parallel.named import settle, wrap
from functional_pp.parallel.shard_map import use_rules
from functional_pp.step.train import TrainStep

__all__ = ["evaluate", "eval_batches"]


def eval_batches(loader) -> int:
    """Batches that cover the held-out windows once (at least one)."""
    return max(1, -(-loader.num_windows // loader.global_batch_size))


def evaluate(step: TrainStep, state: dict, loader, n_batches: int | None = None) -> float:
    """Mean token loss of ``state``'s parameters over the first ``n_batches`` batches of
    ``loader`` (default: all its windows once). Runs on every device of the mesh."""
    from functional_pp.ops import mean
    from functional_pp.ops import sum as nsum
    if step.spec is None:
        raise RuntimeError("evaluate: call step.init(params) first")
    n_batches = eval_batches(loader) if n_batches is None else n_batches
    leaves = optree.tree_leaves(state["params"], none_is_leaf=False)
    total, count = 0.0, 0.0
    with torch.no_grad(), use_rules(step.rules), step.apply_policy():       # the step's ops, same policy
        params: Any = step.named_params(state["params"])
        device = leaves[0].device if leaves else None
        for i in range(n_batches):
            batch = loader.batch(i, each_window_once=True)      # (the wrapped last batch: no token twice)
            if device is not None:
                batch = {k: v.to(device) for k, v in batch.items()}
            nb = {k: wrap(v, step.batch_dims[k]) for k, v in batch.items()}
            loss = float(settle(step.loss_fn(params, nb)).data)
            if "labels" in batch:
                valid = (batch["labels"] != -100).to(torch.float64)
                n = float(settle(nsum(wrap(valid, step.batch_dims["labels"]))).data)
            else:                             # preference pairs: each pair's weight (data/pair_loader.py)
                rows = mean(wrap(batch["pair_weight"].to(torch.float64), step.batch_dims["pair_weight"]), "seq")
                n = float(settle(nsum(rows)).data)
            total += loss * n
            count += n
    return total / max(count, 1.0)
