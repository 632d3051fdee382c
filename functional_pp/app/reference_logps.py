"""``precompute_ref_log_probs`` (TRL's; docs/preference.md "The reference model"): the
reference's log-probability of every pair's chosen and rejected completion, computed once
before the first step on the training mesh (the step's layout and precision, no gradient), and
stored with the pairs (:attr:`~functional_pp.data.pairs.PairSet.ref_logps`), so that the
batches carry them (``ref_chosen_logps`` / ``ref_rejected_logps``) and the reference is not
held during training. The values are written to the run's directory; a resumed run reads them
(its parameters are no longer the reference's)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np
import optree
import torch

from functional_pp import ops
from functional_pp.app.evaluate import eval_batches
from functional_pp.app.host_view import device_loader
from functional_pp.data.pair_loader import PairLoader
from functional_pp.ops.elementwise import broadcast
from functional_pp.parallel.named import settle, wrap
from functional_pp.parallel.shard_map import use_rules
from functional_pp.preference.objective import sequence_logps

__all__ = ["REFERENCE_FILE", "reference_logps", "attach_reference_logps", "check_saved_reference_logps"]

#: the file of a run's precomputed reference log-probabilities (in its output directory)
REFERENCE_FILE = "reference_logps.npz"


def reference_logps(step: Any, state: dict, reference: Callable, pairs: Any, mesh: Any, rules: Any,
                    global_batch: int, seq_len: int) -> np.ndarray:
    """``[pairs, 2]``: the chosen / rejected completions' summed log-probabilities under
    ``reference(params, tokens)`` (logits) of ``state``'s parameters, every pair once, in
    batches of ``global_batch`` pairs laid out as the step lays out its batch; every device
    returns the whole array (each batch's values placed by pair index and summed over the
    data-parallel devices)."""
    indexed = dataclasses.replace(pairs, ref_logps=None, with_index=True)
    loader = device_loader(lambda shard: PairLoader(indexed, global_batch_size=global_batch, seq_len=seq_len,
                                                    drop_last=False, **shard), mesh, rules)
    out = np.zeros((len(pairs), 2), dtype=np.float64)
    leaves = optree.tree_leaves(state["params"], none_is_leaf=False)
    device = leaves[0].device if leaves else None
    with torch.no_grad(), use_rules(step.rules), step.apply_policy():
        params = step.named_params(state["params"])
        slots = wrap(torch.arange(global_batch, dtype=torch.float64, device=device), "slot")
        for i in range(eval_batches(loader)):
            batch = {k: wrap(v.to(device), "batch seq") for k, v in loader.batch(i, each_window_once=True).items()}
            first = i * global_batch                     # this batch's pairs: first, first + 1, ... (wrapped: < first)
            index = ops.mean(batch["pair_index"], "seq")
            for col, side in enumerate(("chosen", "rejected")):
                logps, _ = sequence_logps(reference(params, batch[f"{side}_tokens"]), batch[f"{side}_labels"])
                placed = broadcast(lambda j, s, v: (j - first == s).to(v.dtype) * v.detach(), [index, slots, logps],
                                   "reference log-probs")
                values = settle(ops.sum(placed, "batch")).data.double().reshape(-1)[-global_batch:].cpu().numpy()
                n = min(global_batch, len(pairs) - first)
                out[first:first + n, col] = values[:n]
    return out


def attach_reference_logps(step: Any, state: dict, reference: Callable, data: Any, mesh: Any, rules: Any,
                           global_batch: int, seq_len: int, out_dir: Path, *, fresh: bool, lead: bool) -> None:
    """Set ``data.train`` (and ``data.val``)'s :attr:`ref_logps`: computed by
    :func:`reference_logps` in a fresh run (the lead device writes them to
    :data:`REFERENCE_FILE` in ``out_dir``), read from ``out_dir``'s file in a resumed one
    (:func:`check_saved_reference_logps`)."""
    sets = {"train": data.train, **({"val": data.val} if data.val is not None else {})}
    path = Path(out_dir) / REFERENCE_FILE
    if fresh:
        found = {name: reference_logps(step, state, reference, pairs, mesh, rules, global_batch, seq_len)
                 for name, pairs in sets.items()}
        if lead:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, **found)
    else:
        found = check_saved_reference_logps(out_dir, data)
    for name, pairs in sets.items():
        pairs.ref_logps = found[name]


def check_saved_reference_logps(run_dir: Path, data: Any) -> dict[str, np.ndarray]:
    """The reference log-probabilities a run saved in ``run_dir`` (:data:`REFERENCE_FILE`), per
    pair set of ``data``; a :class:`FileNotFoundError` / :class:`ValueError` when the file is
    missing or holds another number of pairs (read before any work on resuming)."""
    sets = {"train": data.train, **({"val": data.val} if data.val is not None else {})}
    path = Path(run_dir) / REFERENCE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"precompute_ref_log_probs: resuming needs the reference log-probabilities the run "
                                f"computed before its first step ({path}), which is missing; start a new run")
    with np.load(path) as saved:
        found = {name: saved[name] for name in sets if name in saved.files}
    for name, pairs in sets.items():
        if name not in found or len(found[name]) != len(pairs):
            raise ValueError(f"precompute_ref_log_probs: {path} holds the reference log-probabilities of other "
                             f"{name} pairs than this run's; start a new run")
    return found
