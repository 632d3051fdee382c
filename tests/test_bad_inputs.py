"""A catalogue of bad inputs and faults (issue 8, docs/bad_inputs.md): every case asserts the
exact error type, the words a user needs (what, where, how to fix) and, where the input is
refused, that nothing was written or changed. Every case is bounded in time: simulated and
real collectives get short timeouts, subprocesses get ``timeout=``, and pyproject sets a
global per-test timeout."""
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.backends.sim_watch import CollectiveTimeout, DeviceFinishedError
from functional_pp.data import DataLoader
from functional_pp.models import llama
from functional_pp.ops.token_ids import TokenIdError
from functional_pp.process_watch import CollectiveTimeoutError, RankDiedError
from functional_pp.train import NonFiniteError

from harness import local_batch, make_batch

ROOT = Path(__file__).resolve().parents[1]
CFG = llama.Config.tiny()
LOSS = functools.partial(llama.loss, cfg=CFG)
BATCH = make_batch(CFG, batch=4, seq=8, seed=0)
LAYOUTS = {
    "one device": (fpp.Mesh(), fpp.Rules()),
    "tp=2 (vocab-parallel)": (fpp.Mesh(tp=2), llama.default_rules()),
    "dp_shard=2 x tp=2 + sp": (fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True)),
}


def run_steps(mesh, rules, batches, opt=None, loss_fn=LOSS, **kw):
    """Train on ``batches``; returns rank 0's (params before, params after, metrics)."""
    step = fpp.train_step(loss_fn, opt or fpp.optim.adamw(1e-3), mesh=mesh, rules=rules, **kw)

    def device():
        state = step.init(fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=0))
        before = {p: x.clone() for p, x in fpp.leaves_with_paths(state["params"])}
        metrics = []
        for b in batches:
            local = b                                  # one device: the batch as given
            if mesh.size > 1:
                with fpp.use_rules(rules):
                    local = {k: v.data for k, v in local_batch(b, mesh, rules).items()}
            state, m = step(state, local)
            metrics.append(m)
        return before, dict(fpp.leaves_with_paths(state["params"])), metrics
    return fpp.launch(device, mesh, timeout=120)[0]


def with_bad(key, pos, value):
    b = {k: v.clone() for k, v in BATCH.items()}
    b[key][pos] = value
    return b


# =========================================================================== token ids
BAD_IDS = {
    "token id = vocab": ("tokens", (1, 3), CFG.vocab, "embed: token id 256 at position [batch 1, seq 3]"),
    "token id >> vocab": ("tokens", (0, 0), 10 * CFG.vocab, "embed: token id 2560 at position [batch 0, seq 0]"),
    "negative token id": ("tokens", (3, 7), -1, "embed: token id -1 at position [batch 3, seq 7]"),
    "label = vocab": ("labels", (2, 5), CFG.vocab, "cross_entropy: label 256 at position [batch 2, seq 5]"),
    "negative label": ("labels", (2, 5), -7, "cross_entropy: label -7 at position [batch 2, seq 5]"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(BAD_IDS))
def test_out_of_range_ids_give_the_same_error_on_every_layout(case, layout):
    key, pos, value, words = BAD_IDS[case]
    mesh, rules = LAYOUTS[layout]
    if mesh.shape["dp_shard"] > 1 and pos[0] >= 2:   # the row lands on dp rank 1: position is local
        words = words.replace(f"[batch {pos[0]},", f"[batch {pos[0] - 2},")
    with pytest.raises(fpp.DeviceError) as info:
        run_steps(mesh, rules, [with_bad(key, pos, value)])
    err = info.value.original
    assert type(err) is TokenIdError
    assert words in str(err) and "vocabulary of size 256" in str(err) and "valid: 0..255" in str(err)
    assert "model.vocab" in str(err)             # how to fix


def test_ignore_index_labels_are_not_errors_and_all_ignored_is_a_zero_weight_step():
    b = {k: v.clone() for k, v in BATCH.items()}
    b["labels"][:] = fpp.ops.IGNORE_INDEX
    before, after, (m,) = run_steps(*LAYOUTS["tp=2 (vocab-parallel)"], [b], opt=fpp.optim.sgd(0.1))
    assert m["skipped"] == 0 and m["loss"] == 0.0 and m["grad_norm"] == 0.0 and m["tokens"] == 0
    assert all(torch.equal(before[p], after[p]) for p in before)     # zero weight: nothing moved


@pytest.mark.parametrize("op", ["embed", "cross_entropy"])
def test_out_of_range_ids_outside_a_training_step_raise_at_once(op):
    with fpp.use_rules(fpp.Rules()):
        if op == "embed":
            table = fpp.named(torch.randn(10, 4), "vocab hidden")
            call = lambda: fpp.ops.embed(table, fpp.named(torch.tensor([[1, 12]]), "batch seq"))  # noqa: E731
        else:
            logits = fpp.named(torch.randn(1, 2, 10), "batch seq vocab")
            call = lambda: fpp.ops.cross_entropy(logits, fpp.named(torch.tensor([[-3, 1]]), "batch seq"))  # noqa: E731
        with pytest.raises(TokenIdError, match=r"(token id 12|label -3) at position \[batch 0, seq [01]\].*"
                                               r"vocabulary of size 10"):
            call()


# =========================================================================== unnamed tensors
def _unnamed_calls():
    t = torch.randn(2, 3)
    x = fpp.named(torch.randn(2, 3), "batch hidden")
    q = fpp.named(torch.randn(1, 4, 2, 8), "batch seq heads head_dim")
    k = fpp.named(torch.randn(1, 4, 2, 8), "batch seq kv_heads head_dim")
    return {
        "einsum operand 1": (lambda: fpp.einsum("batch hidden, hidden mlp -> batch mlp", x, t), "operand 1"),
        "einsum operand 0": (lambda: fpp.einsum("batch hidden, hidden mlp -> batch mlp", t, x), "operand 0"),
        "embed table": (lambda: fpp.ops.embed(torch.randn(10, 4), x), "table"),
        "embed ids": (lambda: fpp.ops.embed(fpp.named(torch.randn(10, 4), "vocab hidden"),
                                            torch.tensor([[1]])), "ids"),
        "cross_entropy logits": (lambda: fpp.ops.cross_entropy(torch.randn(2, 10), x), "logits"),
        "cross_entropy labels": (lambda: fpp.ops.cross_entropy(
            fpp.named(torch.randn(2, 10), "batch vocab"), torch.tensor([1, 2])), "labels"),
        "attention k": (lambda: fpp.ops.attention(q, torch.randn(1, 4, 2, 8), k), "k"),
        "rename": (lambda: fpp.ops.rename(t, seq="res_seq"), "x"),
        "sum": (lambda: fpp.ops.sum(t, "batch"), "x"),
        "norm (settle)": (lambda: fpp.ops.rms_norm(t, fpp.named(torch.ones(3), "hidden"), "hidden"), "value"),
    }


@pytest.mark.parametrize("case", [
    "einsum operand 1", "einsum operand 0", "embed table", "embed ids", "cross_entropy logits",
    "cross_entropy labels", "attention k", "rename", "sum", "norm (settle)"])
def test_unnamed_tensors_get_the_friendly_type_error(case):
    with fpp.use_rules(fpp.Rules()):
        call, operand = _unnamed_calls()[case]
        with pytest.raises(TypeError, match=rf"{operand} is a Tensor, not a named array; wrap it with "
                                            rf"functional_pp.named"):
            call()


# =========================================================================== batches and seeds
@pytest.mark.parametrize("batch, error, words", [
    ({"tokens": torch.zeros(0, 8, dtype=torch.long), "labels": torch.zeros(0, 8, dtype=torch.long)},
     ValueError, r"batch\['tokens'\] is empty \(shape \(0, 8\)\).*data loader"),
    ({"tokens": BATCH["tokens"], "labels": BATCH["labels"][:, :0]},
     ValueError, r"batch\['labels'\] is empty"),
    ({}, ValueError, r"the batch is empty: pass a dict"),
    ({"tokens": BATCH["tokens"].tolist(), "labels": BATCH["labels"]}, TypeError,
     r"batch\['tokens'\] is a list, not a tensor"),
], ids=["no rows", "no positions", "no keys", "not a tensor"])
def test_empty_or_malformed_batches_are_refused_before_the_step(batch, error, words):
    with pytest.raises(fpp.DeviceError) as info:
        run_steps(fpp.Mesh(), fpp.Rules(), [batch])
    assert type(info.value.original) is error
    assert re.search(words, str(info.value.original))


@pytest.mark.parametrize("seed", [-1, 1.5, True, "0", 2 ** 64])
@pytest.mark.parametrize("where", ["init", "DataLoader"])
def test_bad_seeds_are_refused_with_the_valid_range(seed, where):
    with pytest.raises(ValueError, match=r"seed must be an integer in 0..2\*\*63-1, got .*e\.g\. 0"):
        if where == "init":
            fpp.init(llama.init, CFG, seed=seed)
        else:
            from functional_pp.data import load_corpus
            DataLoader(load_corpus(None, max_bytes=10_000), global_batch_size=2, seq_len=8, seed=seed)


# =========================================================================== non-finite values
def _nan_update_after(n_good: int):
    """SGD whose update turns NaN after ``n_good`` calls (loss and gradients stay finite)."""
    base = fpp.optim.sgd(0.1)
    calls = {"n": 0}

    def update(grads, state, params=None):
        calls["n"] += 1
        updates, state = base.update(grads, state, params)
        if calls["n"] > n_good:
            updates = fpp.optim.transform.tree_map(lambda u: u * float("nan"), updates)
        return updates, state
    return fpp.optim.GradientTransformation(base.init, update)


def test_a_nan_update_with_finite_loss_and_gradients_is_not_applied():
    b = [BATCH, make_batch(CFG, batch=4, seq=8, seed=1)]
    before, after, metrics = run_steps(fpp.Mesh(), fpp.Rules(), b[:1], opt=_nan_update_after(0))
    (m,) = metrics
    assert m["skipped"] == 1 and m["nonfinite_update"] == 1 and m["nonfinite_loss"] == 0
    assert all(torch.equal(before[p], after[p]) for p in before)


def test_a_nan_update_stops_the_run_with_on_nonfinite_raise():
    with pytest.raises(fpp.DeviceError) as info:
        run_steps(*LAYOUTS["tp=2 (vocab-parallel)"], [BATCH], opt=_nan_update_after(0),
                  on_nonfinite="raise")
    assert type(info.value.original) is NonFiniteError
    assert "step 0: optimizer update (with a finite loss" in str(info.value.original)


def test_consecutive_skipped_steps_stop_the_run():
    def nan_loss(params, batch):
        return LOSS(params, batch) * float("nan")
    with pytest.raises(fpp.DeviceError) as info:
        run_steps(fpp.Mesh(), fpp.Rules(), [BATCH] * 5, loss_fn=nan_loss, max_consecutive_skips=3)
    msg = str(info.value.original)
    assert type(info.value.original) is NonFiniteError
    assert "step 2: 3 consecutive steps were skipped" in msg and "max_consecutive_skips=3" in msg
    assert "Lower the learning rate" in msg


def test_a_finite_step_resets_the_consecutive_skip_count():
    calls = {"n": 0}

    def every_other_nan(params, batch):
        calls["n"] += 1
        return LOSS(params, batch) * (float("nan") if calls["n"] % 2 else 1.0)
    _, _, metrics = run_steps(fpp.Mesh(), fpp.Rules(), [BATCH] * 4, loss_fn=every_other_nan,
                              max_consecutive_skips=2)
    assert [m["consecutive_skips"] for m in metrics] == [1, 0, 1, 0]


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_consecutive_skips_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=rf"max_consecutive_skips must be an integer >= 1 \(or None"):
        fpp.train_step(LOSS, fpp.optim.sgd(0.1), max_consecutive_skips=value)


@pytest.mark.parametrize("timeout", [0, -5, float("nan")])
def test_launch_timeout_must_be_positive(timeout):
    with pytest.raises(ValueError, match=r"launch: timeout must be a positive number of seconds"):
        fpp.launch(lambda: None, fpp.Mesh(dp_shard=2), timeout=timeout)
