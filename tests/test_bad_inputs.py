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

import optree
import pytest
import torch
import yaml
from harness import local_batch, make_batch

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.data import DataLoader
from functional_pp.devices.process_watch import CollectiveTimeoutError, RankDiedError
from functional_pp.devices.sim_watch import CollectiveTimeout, DeviceFinishedError
from functional_pp.models import llama
from functional_pp.ops.token_ids import TokenIdError
from functional_pp.step.train import NonFiniteError

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


@pytest.mark.slow
def test_out_of_range_ids_are_caught_inside_a_compiled_step():
    """The deferred check is traced by torch.compile(fullgraph=True): no graph break, same error."""
    with pytest.raises(fpp.DeviceError) as info:
        run_steps(fpp.Mesh(), fpp.Rules(), [with_bad("labels", (0, 1), CFG.vocab + 1)], compile="aot_eager")
    assert type(info.value.original) is TokenIdError
    assert "cross_entropy: label 257 at position [batch 0, seq 1]" in str(info.value.original)


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
        "einsum operand 1": (lambda: fpp.ops.einsum("batch hidden, hidden mlp -> batch mlp", x, t), "operand 1"),
        "einsum operand 0": (lambda: fpp.ops.einsum("batch hidden, hidden mlp -> batch mlp", t, x), "operand 0"),
        "embed table": (lambda: fpp.ops.embed(torch.randn(10, 4), x), "table"),
        "embed ids": (lambda: fpp.ops.embed(fpp.named(torch.randn(10, 4), "vocab hidden"),
                                            torch.tensor([[1]])), "ids"),
        "cross_entropy logits": (lambda: fpp.ops.cross_entropy(torch.randn(2, 10), x), "logits"),
        "cross_entropy labels": (lambda: fpp.ops.cross_entropy(
            fpp.named(torch.randn(2, 10), "batch vocab"), torch.tensor([1, 2])), "labels"),
        "attention k": (lambda: fpp.ops.attention(q, torch.randn(1, 4, 2, 8), k, batch="batch", seq="seq", heads="heads", kv_heads="kv_heads", head_dim="head_dim"), "k"),
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
    ({"tokens": fpp.named(BATCH["tokens"].T.contiguous(), "seq batch"), "labels": BATCH["labels"]}, ValueError,
     r"batch\['tokens'\] is named 'seq batch' but this train_step reads it as 'batch seq'.*batch_dims="),
    ({"tokens": fpp.named(BATCH["tokens"], "batchh seq"), "labels": BATCH["labels"]}, ValueError,
     r"batch\['tokens'\] is named 'batchh seq' but .* 'batch seq'"),
    ({"tokens": BATCH["tokens"][0], "labels": BATCH["labels"][0]}, ValueError,
     r"batch\['tokens'\] has shape \(8,\) but this train_step reads it as 'batch seq' \(2 dimensions"),
    ({"tokens": BATCH["tokens"], "labels": torch.cat([BATCH["labels"], BATCH["labels"][:, :1]], 1)}, ValueError,
     r"cross_entropy: the labels' sizes differ from the logits' \(seq: labels 9, logits 8\).*x\[:, 1:\]"),
    ({"tokens": BATCH["tokens"], "labels": BATCH["labels"][:2]}, ValueError,
     r"cross_entropy: the labels' sizes differ from the logits' \(batch: labels 2, logits 4\)"),
    ({"tokens": BATCH["tokens"], "labels": BATCH["labels"].float()}, TypeError,
     r"cross_entropy: labels must be an integer tensor .* got torch.float32"),
], ids=["no rows", "no positions", "no keys", "not a tensor", "named transposed", "named misspelt", "one dimension",
        "labels unshifted", "labels fewer rows", "labels float"])
def test_empty_or_malformed_batches_are_refused_before_the_step(batch, error, words):
    with pytest.raises(fpp.DeviceError) as info:
        run_steps(fpp.Mesh(), fpp.Rules(), [batch])
    assert type(info.value.original) is error
    assert re.search(words, str(info.value.original))


@pytest.mark.multiprocess
def test_a_misnamed_batch_is_refused_on_real_gloo_processes_too():
    """The same refusal where each rank is a process (the batch split over dp_shard)."""
    mesh, rules = fpp.Mesh(dp_shard=2), llama.default_rules()
    step = fpp.train_step(LOSS, fpp.optim.adamw(1e-3), mesh=mesh, rules=rules)

    def device():
        state = step.init(fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=0))
        with fpp.use_rules(rules):
            batch = {"tokens": fpp.named(BATCH["tokens"].T.contiguous(), "seq batch"),
                     "labels": fpp.named(BATCH["labels"], "batch seq")}
        step(state, batch)
    with pytest.raises(fpp.DeviceError) as info:
        fpp.launch(device, mesh, processes=True, timeout=60)
    assert type(info.value.original) is ValueError
    assert "batch['tokens'] is named 'seq batch' but this train_step reads it as 'batch seq'" in str(info.value)


@pytest.mark.parametrize("rules, close", [
    (fpp.Rules(mpl="tp"), "mlp"),
    (llama.default_rules(tp=False).replace(mpl="tp"), "mlp"),       # (a default rule replaced: checked)
    (fpp.Rules(vocab="tp", hidden_dim="tp"), "hidden"),
], ids=["mpl", "defaults + mpl", "hidden_dim"])
def test_a_misspelt_rule_name_is_refused_at_the_first_step(rules, close):
    """``Rules(mpl="tp")`` (a typo of ``mlp``) was accepted and never used: the MLP trained whole
    on every device, silently. Refused after the first step (when the names the parameters,
    the batch and the ops use are known), naming the rule, the close name and the used ones."""
    with pytest.raises(fpp.DeviceError) as info:
        run_steps(fpp.Mesh(tp=2), rules, [BATCH])
    msg = str(info.value.original)
    assert type(info.value.original) is ValueError
    typo = "mpl" if close == "mlp" else "hidden_dim"
    assert f"train_step: the rule {typo}=('tp',) names a dimension that no parameter, batch entry or op" in msg
    assert f"did you mean {close}=('tp',)?" in msg and "'kv_heads'" in msg and f"{close}=None keeps it whole" in msg


@pytest.mark.parametrize("rules", [
    fpp.Rules(mlp="tp", experts="tp"),           # a rule for another model's dimension: model-agnostic rules
    fpp.Rules(mpl="tp", mlp=None),               # the close name has a rule of its own: mpl is meant elsewhere
    llama.default_rules(),                       # library defaults name Mamba's and MoE's dimensions too
], ids=["experts on a dense model", "close name ruled", "defaults"])
def test_rules_for_names_the_model_lacks_are_accepted(rules):
    before, after, metrics = run_steps(fpp.Mesh(tp=2), rules, [BATCH, BATCH])
    assert len(metrics) == 2 and all(m["skipped"] == 0 for m in metrics)


@pytest.mark.parametrize("call, error, words", [
    (lambda: fpp.launch(lambda: None, 5), TypeError, r"launch\(fn, mesh\): mesh must be a functional_pp.Mesh, got int 5 "
                                                    r"\(e.g. fpp.Mesh\(dp_shard=5\)"),
    (lambda: fpp.train_step(LOSS, "adamw"), TypeError, r"train_step: optimizer must be an \(init, update\) pair such as "
                                                       r"functional_pp.optim.adamw\(3e-4\).*got str 'adamw'"),
    (lambda: fpp.train_step(LOSS, fpp.optim.adamw(1e-3), mesh=fpp.Mesh(), rules={"mlp": "tp"}), TypeError,
     r"rules must be a functional_pp.Rules, got dict .*wrap it: fpp.Rules\(\{'mlp': 'tp'\}\)"),
    (lambda: fpp.Rules(mlp=3), TypeError, r"the rule for dim 'mlp' must be a mesh axis name.*got 3"),
    (lambda: fpp.Rules(mlp=[["tp"]]), TypeError, r"the rule for dim 'mlp' must be a mesh axis name.*got \[\['tp'\]\]"),
    (lambda: fpp.param((4, 4), "hidden hidden"), ValueError, r"dimension name 'hidden' is given twice"),
    (lambda: fpp.param((4, -1), "hidden mlp"), ValueError, r"every size must be a number >= 0, got -1"),
    (lambda: fpp.param((4, 64 / 3), "hidden mlp"), ValueError, r"every size must be a whole number, got 21.33"),
    (lambda: fpp.train_step(LOSS, fpp.optim.adamw(1e-3), mesh=fpp.Mesh(tpp=2), rules=llama.default_rules()), ValueError,
     r"train_step: mesh axis 'tpp' \(size 2\) is named by no rule, while 'tp'.* has size 1: did you mean Mesh\(tp=2\)"),
], ids=["launch mesh int", "optimizer str", "rules dict", "rule int", "rule nested list", "param dims twice",
        "param negative", "param fractional (was truncated)", "mesh axis tpp"])
def test_bad_api_arguments_are_refused_where_they_are_given(call, error, words):
    """Each of these failed later (inside the first step or ``init``) with an AttributeError,
    ``'int' object is not iterable``, a torch shape error, or ran with nothing split (``tpp``)."""
    with pytest.raises(error, match=words):
        call()


def test_a_loss_function_returning_a_tuple_is_named():
    def with_aux(params, batch):
        return LOSS(params, batch), {"aux": 1}
    with pytest.raises(fpp.DeviceError) as info:
        run_steps(fpp.Mesh(), fpp.Rules(), [BATCH], loss_fn=with_aux)
    assert type(info.value.original) is TypeError
    assert "train_step: loss_fn(params, batch) returned a tuple; it must return the loss alone" in str(info.value)


def test_a_batch_without_the_key_the_loss_reads_names_the_batchs_keys():
    """The loss's own ``KeyError: 'labels'`` said neither where nor what the batch holds."""
    batch = {k: v for k, v in BATCH.items() if k != "labels"}
    with pytest.raises(fpp.DeviceError) as info:
        run_steps(fpp.Mesh(), fpp.Rules(), [batch])
    assert type(info.value.original) is KeyError
    assert f"loss_fn read 'labels', which the batch does not have: the batch has {sorted(batch)}" in str(info.value)


@pytest.mark.parametrize("part", ["opt_state", "params"])
def test_a_state_of_another_parameter_tree_is_named_not_a_torch_shape_error(part):
    """An optimizer state (or parameters) from another model size failed inside torch with "The
    size of tensor a (16) must match the size of tensor b (8)"; now the leaves are named."""
    mesh, rules = fpp.Mesh(), fpp.Rules()
    step = fpp.train_step(LOSS, fpp.optim.adamw(1e-3), mesh=mesh, rules=rules)
    other_cfg = llama.Config.tiny(hidden=2 * CFG.hidden)
    other = fpp.train_step(functools.partial(llama.loss, cfg=other_cfg), fpp.optim.adamw(1e-3), mesh=mesh, rules=rules)

    def device():
        state = step.init(fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=0))
        foreign = other.init(fpp.init(llama.init, other_cfg, mesh=mesh, rules=rules, seed=0))
        step(dict(state, **{part: foreign[part]}), BATCH)
    with pytest.raises(fpp.DeviceError) as info:
        fpp.launch(device, mesh, timeout=120)
    assert type(info.value.original) is ValueError
    msg = str(info.value.original)
    assert f"its {part} belong to another parameter tree" in msg and "step.init(params) of this model" in msg
    assert re.search(rf"{part}\.\S*embed\S*: shape \(\d+, {2 * CFG.hidden}\), step.init made \(\d+, {CFG.hidden}\)",
                     msg), msg


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
            updates = optree.tree_map(lambda u: u * float("nan"), updates)
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


# =========================================================================== simulated faults
MESH3 = fpp.Mesh(dp_shard=3)


def test_a_device_returning_early_fails_its_peers_at_once():
    def fn():
        if fpp.current_rank() == 1:
            return "done early"
        return fpp.psum(torch.ones(2), "dp_shard")
    with pytest.raises(fpp.DeviceError) as info:
        fpp.launch(fn, MESH3, timeout=1200)               # the error type shows it was not the timeout
    err = info.value.original
    assert type(err) is DeviceFinishedError
    assert "waits in collective all_reduce_sum #0 over devices (0, 1, 2), but device 1 already returned" in str(err)
    assert "device 1: returned from the launched function" in str(err)


_BLOCKED_DEVICE = """
import time, torch, functional_pp as fpp
from functional_pp.devices.sim_watch import CollectiveTimeout
def fn():
    if fpp.current_rank() == 2:
        time.sleep(30)                               # blocked, no CPU time used (abandoned after 10 s)
    return float(fpp.psum(torch.ones(()), "dp_shard"))
try:
    fpp.launch(fn, fpp.Mesh(dp_shard=3), timeout=1.5)
    print("NO ERROR")
except fpp.DeviceError as exc:
    print(type(exc.original).__name__ + ": " + str(exc.original))
"""


def test_a_device_blocked_outside_collectives_times_out_naming_where_each_device_is():
    # a fresh process: CPU used by other threads of a busy process counts as progress
    # (docs/bad_inputs.md), and a test suite's process has leftover threads
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _BLOCKED_DEVICE], capture_output=True, text=True,
                         timeout=300, env=env)
    msg = out.stdout
    assert msg.startswith(CollectiveTimeout.__name__ + ":"), out.stdout + out.stderr
    assert "made no progress for" in msg and "for devices [2]" in msg
    assert "device 0: waiting in all_reduce_sum #0" in msg and "device 2: running (no collective yet)" in msg
    assert "raise launch(timeout=...)" in msg


def test_a_slow_busy_device_does_not_trip_the_simulated_timeout():
    def fn():
        if fpp.current_rank() == 0:                      # 4 s of work, no collective, timeout 1.5 s
            t0, x = time.monotonic(), torch.zeros(())
            while time.monotonic() - t0 < 4:
                x = x + torch.randn(64).sum()
        return float(fpp.psum(torch.ones(()), "dp_shard"))
    assert fpp.launch(fn, MESH3, timeout=1.5) == [3.0, 3.0, 3.0]


# =========================================================================== real-process faults
def _stop_self_at_second_collective(sig):
    def fn():
        x = fpp.psum(torch.ones(2), "dp_shard")
        if fpp.current_rank() == 1:
            if sig is None:
                time.sleep(120)                          # alive but stuck outside collectives
            else:
                os.kill(os.getpid(), sig)
        return float(fpp.psum(x, "dp_shard").sum())
    return fn


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("sig, words", [
    (signal.SIGKILL, "the process of rank 1 (pid"),
    (signal.SIGSTOP, "the process of rank 1 (pid"),
], ids=["killed", "stalled (SIGSTOP)"])
def test_a_killed_or_stalled_rank_is_named_within_the_timeout(sig, words):
    with pytest.raises(fpp.DeviceError) as info:
        fpp.launch(_stop_self_at_second_collective(sig), fpp.Mesh(dp_shard=2), processes=True, timeout=5)
    err = info.value.original
    assert type(err) is RankDiedError and info.value.rank == 1
    assert words in str(err)
    assert ("killed by SIGKILL" if sig == signal.SIGKILL else "stopped (SIGSTOP") in str(err)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_stuck_outside_collectives_is_named_by_its_peers():
    with pytest.raises(fpp.DeviceError) as info:
        fpp.launch(_stop_self_at_second_collective(None), fpp.Mesh(dp_shard=2), processes=True, timeout=5)
    err = info.value.original
    assert type(err) is CollectiveTimeoutError and info.value.rank == 0
    assert "collective timeout (5s)" in str(err) and "ranks [1] did not check in" in str(err)
    assert "Raise collective_timeout" in str(err)


# =========================================================================== checkpoints
D = {"w": fpp.Param((8, 4), ("vocab", "hidden")), "b": fpp.Param((4,), ("hidden",))}
RULES2 = fpp.Rules(vocab="dp_shard")


def _save(root, step=1, mesh=None, seed=1):
    if mesh is None:
        return ck.save_checkpoint(root, step, {"params": fpp.init_params(D, seed=seed)}, {"params": D})

    def device():
        params = fpp.init_params(D, seed=seed, mesh=mesh, rules=RULES2)
        return ck.save_checkpoint(root, step, {"params": params}, {"params": D}, rules=RULES2)
    return fpp.launch(device, mesh, timeout=60)[0]


def _edit_index(ckpt, fn):
    index = json.loads((ckpt / "index.json").read_text())
    fn(index)
    del index["sha256"]             # (the deeper checks, for an index whose hash was removed)
    (ckpt / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("name", ["../other/rank-00000.safetensors", "ABS", "link.safetensors"],
                         ids=["dot-dot", "absolute", "symlink out"])
def test_index_json_may_only_name_files_inside_the_checkpoint(tmp_path, name):
    other = tmp_path / "other"
    _save(other)
    ckpt = _save(tmp_path / "run")
    target = other / "step-000001" / "rank-00000.safetensors"
    if name == "ABS":
        name = str(target)
    if name == "link.safetensors":
        (ckpt / name).symlink_to(target)
    _edit_index(ckpt, lambda ix: [c.update(file=name) for e in ix["tensors"].values() for c in e["chunks"]])
    with pytest.raises(ck.CheckpointCorruptError, match=r"outside the checkpoint directory .*only files "
                                                        r"inside it are read"):
        ck.load_checkpoint(ckpt, {"params": D})


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABS"], ids=["dot-dot", "absolute"])
@pytest.mark.parametrize("reader", ["load_safetensors", "hf.load_hf_params"])
def test_a_hugging_face_index_may_only_name_files_inside_the_directory(tmp_path, name, reader):
    from safetensors.torch import save_file
    outside = tmp_path / "outside.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(outside))
    model = tmp_path / "model"
    model.mkdir()
    name = str(outside) if name == "ABS" else name
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": name}}))
    with pytest.raises(ck.CheckpointCorruptError, match=r"model.safetensors.index.json names file .*outside "
                                                        r"the checkpoint directory"):
        if reader == "load_safetensors":
            ck.load_safetensors(model, {"w": ck.Spec((2, 2), "a b")},
                                name_map=lambda p: "model.embed_tokens.weight")
        else:
            from functional_pp.checkpoint import hf
            hf.load_hf_params(model, CFG)


def _flip_byte(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("byte", [20, 100], ids=["second half of w", "first half of w"])
def test_a_flipped_byte_is_caught_by_a_resharding_load(tmp_path, byte):
    """The file ends with w's 128 bytes then b's 16: each device reads one half of w, and a
    flipped byte in either half is caught on every device (the whole chunk is verified)."""
    ckpt = _save(tmp_path)                                 # one chunk per tensor
    _flip_byte(ckpt / "rank-00000.safetensors", byte)
    mesh = fpp.Mesh(dp_shard=2)

    def device():                                          # each device reads half of w
        return ck.load_checkpoint(ckpt, {"params": D}, rules=RULES2)
    with pytest.raises(fpp.DeviceError) as info:
        fpp.launch(device, mesh, timeout=60)
    assert type(info.value.original) is ck.CheckpointCorruptError
    assert "fails its checksum (the file is corrupted)" in str(info.value.original)


def test_swapped_chunk_coordinates_in_index_json_are_caught(tmp_path):
    ckpt = _save(tmp_path, mesh=fpp.Mesh(dp_shard=2))     # w saved as two chunks, one per rank

    def swap(ix):
        a, b = ix["tensors"]["params.w"]["chunks"]
        a["start"], b["start"], a["stop"], b["stop"] = b["start"], a["start"], b["stop"], a["stop"]
    _edit_index(ckpt, swap)
    with pytest.raises(ck.CheckpointCorruptError, match=r"index.json says tensor 'params.w' in this file is "
                                                        r"the region .* but the file records"):
        ck.load_checkpoint(ckpt, {"params": D})


@pytest.mark.parametrize("edit", [lambda ix: ix.update(step=5), lambda ix: ix.update(metadata={"loader": {"step": 0}}),
                                  lambda ix: ix["config"].update(learning_rate=1.0)],
                         ids=["step", "loader position", "config"])
def test_hand_edited_checkpoint_metadata_is_refused(tmp_path, edit):
    """index.json holds the SHA-256 of the rest of itself: an edited step, loader position or
    config (trusted before: steps repeated or skipped silently) is refused naming the file and
    the way out; without its hash the edit loads as it is."""
    ckpt = ck.save_checkpoint(tmp_path, 1, {"params": fpp.init_params(D, seed=1)}, {"params": D},
                              metadata={"loader": {"step": 1}}, config={"learning_rate": 1e-3})
    assert ck.load_checkpoint(ckpt, {"params": D}).metadata == {"loader": {"step": 1}}
    index = json.loads((ckpt / "index.json").read_text())
    edit(index)
    (ckpt / "index.json").write_text(json.dumps(index))
    with pytest.raises(ck.CheckpointCorruptError, match=r"step-000001/index.json was changed after it was saved: "
                                                        r"its 'sha256' does not match .*delete its 'sha256' field"):
        ck.load_checkpoint(ckpt, {"params": D})
    _edit_index(ckpt, lambda ix: None)
    assert ck.load_checkpoint(ckpt, {"params": D}).index["step"] == index["step"]


def test_each_rank_file_records_its_chunk_coordinates(tmp_path):
    from safetensors import safe_open
    ckpt = _save(tmp_path, mesh=fpp.Mesh(dp_shard=2))
    with safe_open(str(ckpt / "rank-00001.safetensors"), framework="pt") as f:
        recorded = json.loads(f.metadata()["functional_pp.chunks"])
    assert recorded["params.w"] == [[4, 0], [8, 4]]


def test_stale_pointer_temp_files_are_removed_by_the_next_save(tmp_path):
    _save(tmp_path, 1)
    stale = [tmp_path / "latest.tmp-0badf00d", tmp_path / "step-000002.tmp-12345678"]
    stale[0].write_text("step-000001\n")
    stale[1].mkdir()
    _save(tmp_path, 2)
    assert not any(p.exists() for p in stale)
    assert (tmp_path / "latest").read_text().strip() == "step-000002"


_SAVE_AND_DIE = """
import sys, torch, functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import format as fmt
D = {"w": fpp.Param((256, 256), ("vocab", "hidden"))}
root = sys.argv[1]
ck.save_checkpoint(root, 1, {"params": fpp.init_params(D, seed=1)}, {"params": D})
real = fmt.write_safetensors
def slow(path, items, metadata=None):
    def produce_slowly(produce):
        def inner():
            open(root + "/SAVING", "w").close()
            import time; time.sleep(600)             # killed here, mid-write
            return produce()
        return inner
    return real(path, [(n, d, s, produce_slowly(p)) for n, d, s, p in items], metadata)
fmt.write_safetensors = slow
import functional_pp.checkpoint.save as save_mod
save_mod.fmt.write_safetensors = slow
ck.save_checkpoint(root, 2, {"params": fpp.init_params(D, seed=2)}, {"params": D})
"""


@pytest.mark.slow
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _SAVE_AND_DIE, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "SAVING").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the saving process never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [p.name for p in tmp_path.glob("step-000002.tmp-*")]        # the interrupted save
    D1 = {"w": fpp.Param((256, 256), ("vocab", "hidden"))}
    r = ck.load_checkpoint(tmp_path, {"params": D1})
    assert r.step == 1 and torch.equal(r.tree["params"]["w"], fpp.init_params(D1, seed=1)["w"])
    ck.save_checkpoint(tmp_path, 3, {"params": fpp.init_params(D1, seed=3)}, {"params": D1})
    assert not list(tmp_path.glob("*.tmp-*"))                          # cleaned by the next save


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only; skipped otherwise with the reason)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs, which only root can mount")
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here (a container without CAP_SYS_ADMIN?): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_a_full_disk_fails_the_save_cleanly_and_keeps_the_previous_checkpoint(tiny_tmpfs):
    small = {"w": fpp.Param((16, 16), ("vocab", "hidden"))}
    big = {"w": fpp.Param((1024, 1024), ("vocab", "hidden"))}              # 4 MiB > 1 MiB
    ck.save_checkpoint(tiny_tmpfs, 1, {"params": fpp.init_params(small)}, {"params": small})
    with pytest.raises(ck.CheckpointError, match=r"could not write checkpoint file .*No space left on "
                                                  r"device.*previous checkpoint is untouched"):
        ck.save_checkpoint(tiny_tmpfs, 2, {"params": fpp.init_params(big)}, {"params": big})
    assert ck.CheckpointManager(tiny_tmpfs).steps() == [1]
    assert not list(tiny_tmpfs.glob("*.tmp-*"))
    assert ck.load_checkpoint(tiny_tmpfs, {"params": small}).step == 1


# =========================================================================== command line
def write_cfg(path: Path, out: Path, **overrides) -> Path:
    corpus = path.parent / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = {"micro_batch_size": 2, "sequence_len": 16, "learning_rate": 1e-3, "lr_scheduler": "constant",
           "max_steps": 2, "model": {"preset": "tiny", "layers": 1}, "data": {"path": str(corpus)},
           "logging": {"output_dir": str(out), "log_every": 1, "plot": False},
           "checkpoint": {"save_every": 1}}
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_cli(capsys, *argv):
    status = cli.main(["train", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line(err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture
def finished_run(tmp_path, capsys):
    """A 2-step run with checkpoints at steps 1 and 2."""
    out = tmp_path / "run"
    cfg = write_cfg(tmp_path / "c.yaml", out)
    assert run_cli(capsys, cfg)[0] == 0
    return cfg, out


def _snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("change, key", [
    ({"learning_rate": 5e-3}, "learning_rate: checkpoint 0.001, now 0.005"),
    ({"model": {"preset": "tiny", "layers": 2}}, "model.layers: checkpoint 1, now 2"),
    ({"seed": 7}, "seed: checkpoint 0, now 7"),
    ({"micro_batch_size": 4}, "global batch (sequences per step): checkpoint 2, now 4"),
    ({"lr_scheduler": "cosine"}, "lr_scheduler: checkpoint 'constant', now 'cosine'"),
], ids=["learning rate", "model", "seed", "batch", "schedule"])
def test_resume_refuses_config_changes_that_break_exact_resumption(tmp_path, capsys, finished_run, change, key):
    cfg, out = finished_run
    before = _snapshot(out)
    write_cfg(cfg, out, max_steps=3, **change)
    status, stdout, err = run_cli(capsys, cfg, "--resume")
    assert status == 2
    assert_one_line(err, "config error: --resume: the config differs", key, "--allow-config-change")
    assert stdout == "" and _snapshot(out) == before                 # nothing written


@pytest.mark.slow
def test_resume_accepts_changes_that_keep_the_results_and_allow_config_change(tmp_path, capsys, finished_run):
    cfg, out = finished_run
    write_cfg(cfg, out, max_steps=3, logging={"log_every": 5}, collective_timeout=100.0)  # harmless
    assert run_cli(capsys, cfg, "--resume")[0] == 0
    write_cfg(cfg, out, max_steps=4, learning_rate=5e-3)
    status, stdout, err = run_cli(capsys, cfg, "--resume", "--allow-config-change")
    assert status == 0 and "resuming from" in stdout and err == ""


@pytest.mark.slow
@pytest.mark.parametrize("debug", [False, True], ids=["one line", "--debug"])
def test_a_corrupt_checkpoint_on_resume_is_one_line_unless_debug(tmp_path, capsys, finished_run, debug):
    cfg, out = finished_run
    write_cfg(cfg, out, max_steps=3)
    _flip_byte(out / "checkpoints" / "step-000002" / "rank-00000.safetensors", 3)
    status, _, err = run_cli(capsys, cfg, "--resume", *(["--debug"] if debug else []))
    assert status == 1
    if debug:
        assert "Traceback (most recent call last)" in err and "CheckpointCorruptError" in err
    else:
        assert_one_line(err, "functional-pp: error: DeviceError: device 0", "fails its checksum",
                        "run with --debug")


def test_an_unwritable_output_directory_is_refused_before_the_summary(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = write_cfg(tmp_path / "c.yaml", blocker / "run")
    status, stdout, err = run_cli(capsys, cfg)
    assert status == 2 and stdout == ""                               # no start-up summary
    assert_one_line(err, f"output directory {blocker / 'run'} is not writable", "--output DIR")


@pytest.mark.parametrize("override, words", [
    ("seed=-1", "seed must be an integer in 0..2**63-1, got -1"),
    ("max_consecutive_skips=0", "max_consecutive_skips must be >= 1"),
    ("collective_timeout=0", "collective_timeout must be a positive number of seconds"),
    ("collective_timeout=-3.5", "collective_timeout must be a positive number of seconds"),
], ids=["seed -1", "max_consecutive_skips 0", "collective_timeout 0", "collective_timeout negative"])
def test_bad_hardening_keys_are_config_errors_before_any_work(tmp_path, capsys, override, words):
    out = tmp_path / "run"
    cfg = write_cfg(tmp_path / "c.yaml", out)
    status, stdout, err = run_cli(capsys, cfg, "--set", override)
    assert status == 2 and stdout == "" and not out.exists()
    assert_one_line(err, "functional-pp: config error:", words)


@pytest.mark.parametrize("override, words", [
    ("adam_beta2=1.5", "scale_by_adam: b2=1.5 is outside [0, 1) (the second-moment decay, e.g. 0.95 or 0.999) "
                       "[config key: adam_beta2]"),
    ("adam_epsilon=-1e-8", "eps=-1e-08 is outside (0, inf)"),
], ids=["adam_beta2 1.5", "adam_epsilon negative"])
def test_validate_makes_the_optimizers_checks_as_train_does(tmp_path, capsys, override, words):
    """``validate`` said ``config ok`` for settings the optimizer refuses when ``train`` builds it."""
    cfg = write_cfg(tmp_path / "c.yaml", tmp_path / "run")
    assert cli.main(["validate", str(cfg), "--set", override]) == 2
    out, err = capsys.readouterr()
    assert "config ok" not in out
    assert_one_line(err, "functional-pp: config error: optimizer settings:", words)


def test_a_dataset_without_type_names_the_type_its_records_look_like(tmp_path, capsys):
    """A dataset entry without ``type`` is read as completion text (field ``text``): alpaca records
    were refused as "record 1 has no field 'text'" without saying why that field was looked for."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"instruction": f"say {i}", "input": "", "output": f"ok {i}"}) + "\n"
                            for i in range(8)))
    cfg = write_cfg(tmp_path / "c.yaml", tmp_path / "run", data=None, datasets=[{"path": str(rows)}])
    assert cli.main(["validate", str(cfg)]) == 2
    assert_one_line(capsys.readouterr().err, "datasets[0] (", "record 1 has no field 'text'",
                    "the dataset has no type, so it is read as completion text from field 'text': its fields look "
                    "like type alpaca: set datasets[0].type: alpaca")


def test_axolotls_test_datasets_is_refused_without_pointing_at_datasets(tmp_path, capsys):
    """It said "unknown key 'test_datasets'; did you mean 'datasets'?": following that hint
    trains on the evaluation data."""
    out = tmp_path / "run"
    cfg = write_cfg(tmp_path / "c.yaml", out)
    status, stdout, err = run_cli(capsys, cfg, "--set", "test_datasets=[{path: eval.jsonl, type: alpaca}]")
    assert status == 2 and stdout == "" and not out.exists()
    assert_one_line(err, "'test_datasets' is not supported", "val_set_size", "it would be trained on")
    assert "did you mean 'datasets'" not in err


def test_an_unreadable_config_file_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"learning_rate: \xff\xfe\n")                  # not UTF-8
    status, stdout, err = run_cli(capsys, cfg)
    assert status == 2 and stdout == ""
    assert_one_line(err, f"functional-pp: config error: cannot read config file {cfg}", "UTF-8")


@pytest.mark.slow
def test_training_that_keeps_producing_nan_stops_with_exit_status_3(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = write_cfg(tmp_path / "c.yaml", out, learning_rate=1e30, max_steps=6, max_consecutive_skips=2,
                    max_grad_norm=None)
    status, stdout, err = run_cli(capsys, cfg)
    assert status == 3
    assert_one_line(err, "2 consecutive steps were skipped", "max_consecutive_skips=2")
    assert "done:" not in stdout


def test_the_process_exit_status_and_stderr_of_a_runtime_error(tmp_path):
    """As a user sees it: ``python -m functional_pp train`` on a bad checkpoint directory."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step-000001").mkdir(parents=True)
    (out / "checkpoints" / "step-000001" / "index.json").write_text("{not json")
    cfg = write_cfg(tmp_path / "c.yaml", out)
    res = subprocess.run([sys.executable, "-m", "functional_pp", "train", str(cfg), "--resume"],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 1, res.stderr
    assert_one_line(res.stderr, "functional-pp: error: CheckpointCorruptError:", "index.json is not valid JSON")


_TORCHRUN_STALL = """
import os, signal, torch, functional_pp as fpp
def fn():
    x = fpp.psum(torch.ones(2), "dp_shard")
    if fpp.current_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)             # stalled: alive, never answers
    return float(fpp.psum(x, "dp_shard").sum())
fpp.launch(fn, fpp.Mesh(dp_shard=2), timeout=5)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_torchrun_a_stalled_rank_is_named_by_its_peer_within_the_timeout(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(_TORCHRUN_STALL)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "2", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:                          # the agent waits for the stopped rank
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "CollectiveTimeoutError: rank 0: a collective failed after waiting up to the collective " \
           "timeout (5s)" in out, out[-3000:]
    assert "ranks [1] did not check in" in out
