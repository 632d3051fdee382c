"""The eager step's low-overhead mechanisms (docs/eager_overhead.md): no host read inside the
step (one transfer after it), skipped steps keep the old state chosen on the host, positions
and rotary tables built once across steps."""
from __future__ import annotations

import functools
import importlib

import optree
import pytest
import torch
from host_reads import HostReads as _HostReads  # noqa: F401 (a fixture)
from host_reads import transfers
from torch.utils._python_dispatch import TorchDispatchMode

import functional_pp as fpp
from functional_pp.models import llama

attention_ops = importlib.import_module("functional_pp.ops.attention")    # (the package exports
rotary_ops = importlib.import_module("functional_pp.ops.rotary")          # functions of these names)

CFG = llama.Config(vocab=64, hidden=16, layers=2, heads=2, kv_heads=1, mlp=32, max_seq=16,
                   tie_embeddings=False, rope_scaling=None)


def _batch(seed: int = 1) -> dict:
    ids = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _step(**options):
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-2, weight_decay=0.1,
                                                                                   clip_norm=1.0), **options)
    return step, step.init(fpp.init(llama.init, CFG, seed=0))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])     # bf16: the GPU benchmark's setting (benchmarks/gpu.py)
@pytest.mark.parametrize("donate_state", [False, True], ids=["new-state", "donated-state"])
@pytest.mark.parametrize("nan_loss", [False, True], ids=["finite", "skipped"])
def test_a_step_reads_the_device_once_after_its_work(transfers, nan_loss, donate_state, precision):
    step, state = _step(max_consecutive_skips=None, donate_state=donate_state, precision=precision)
    loss_fn = step.loss_fn
    if nan_loss:      # a skipped step: the guard and the choice of the old state make no read either
        step.loss_fn = lambda p, b: loss_fn(p, b) * float("nan")
    state, _ = step(state, _batch())            # warm: plans and memos built
    inner = []
    device_step = step._device_step

    def watched(*args):
        n = len(transfers)
        with _HostReads() as mode:
            out = device_step(*args)
        inner.append((len(mode.reads), len(transfers) - n))
        return out
    step._device_step = watched
    before = [t.clone() for t in optree.tree_leaves(state["params"])]
    del transfers[:]
    with _HostReads() as mode:
        new_state, metrics = step(state, _batch(2))
    assert inner == [(0, 0)], "the step's own work reads nothing on the host"
    assert mode.reads == [] and transfers == ["tolist"], "one transfer of the metrics after the step"
    assert metrics["skipped"] == (1 if nan_loss else 0)
    kept = [torch.equal(a, b) for a, b in zip(optree.tree_leaves(new_state["params"]), before)]
    assert all(kept) if nan_loss else not any(kept)
    same = [a is b for a, b in zip(optree.tree_leaves(new_state["params"]), optree.tree_leaves(state["params"]))]
    if donate_state:       # adamw's in-place step: written into the state passed in (or left as it was)
        assert all(same)
    else:                  # new buffers; a skipped step returns the old state itself
        assert all(same) if nan_loss else not any(same)


def test_a_skipped_eager_step_returns_the_old_state_itself():
    step, state = _step(max_consecutive_skips=None)
    loss_fn = step.loss_fn
    step.loss_fn = lambda p, b: loss_fn(p, b) * float("nan")
    new_state, metrics = step(state, _batch())
    assert metrics["skipped"] == 1 and metrics["nonfinite_loss"] == 1
    assert new_state["params"] is state["params"] and new_state["opt_state"] is state["opt_state"]
    assert int(new_state["step"]) == 1 and int(new_state["skipped"]) == 1


def test_an_infinite_update_of_one_element_is_refused_with_finite_gradients():
    base = fpp.optim.sgd(0.1)

    def update(grads, state, params=None):         # one element of one leaf's update is -inf
        updates, state = base.update(grads, state, params)
        leaves, spec = optree.tree_flatten(updates)
        leaves[3] = leaves[3].clone()
        leaves[3].view(-1)[5] = -float("inf")
        return optree.tree_unflatten(spec, leaves), state
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.GradientTransformation(base.init, update),
                          max_consecutive_skips=None)
    state = step.init(fpp.init(llama.init, CFG, seed=0))
    after, m = step(state, _batch())
    assert (m["nonfinite_update"], m["nonfinite_grad"], m["nonfinite_loss"], m["skipped"]) == (1, 0, 0, 1)
    assert after["params"] is state["params"]


def test_positions_and_rotary_tables_are_built_once_across_steps(monkeypatch):
    calls = []
    original = rotary_ops.inverse_frequencies
    monkeypatch.setattr(rotary_ops, "inverse_frequencies", lambda *a, **k: calls.append(a) or original(*a, **k))
    attention_ops._OUTSIDE_A_MESH.clear()
    step, state = _step()
    for seed in range(3):
        state, _ = step(state, _batch(seed))
    assert len(calls) == 1, "one table for every layer, q and k, and step"


def test_a_repeated_step_derives_no_op_plan(monkeypatch):
    """Every op's layout decisions (einsum, elementwise, attention, rename, wrap) are derived on
    the first step and replayed afterwards: the second step derives nothing."""
    einsum_ops = importlib.import_module("functional_pp.ops.einsum")
    elementwise_ops = importlib.import_module("functional_pp.ops.elementwise")
    shape_ops = importlib.import_module("functional_pp.ops.shape")
    derived = []
    for module, name in ((einsum_ops, "_derive_plan"), (elementwise_ops, "_binary_layout"),
                         (attention_ops, "_attention_plan"), (shape_ops, "_rename_plan")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name, **k: derived.append(_n) or _o(*a, **k))
    step, state = _step()
    state, _ = step(state, _batch(1))
    assert {"_derive_plan", "_binary_layout", "_attention_plan", "_rename_plan"} <= set(derived)
    derived.clear()
    state, _ = step(state, _batch(2))
    assert derived == []


def test_op_plans_keep_the_outside_a_mesh_error_and_bad_input_errors():
    """The plan tables do not skip validation: splitting rules outside a mesh raise at every
    call, and a cached wrap still rejects a block whose rank does not match the names."""
    split = fpp.Rules(batch="dp_shard")
    x = fpp.named(torch.ones(2, 3), "batch hidden")
    for _ in range(2):
        with fpp.use_rules(split), pytest.raises(RuntimeError, match="no mesh is running"):
            x * x
    fpp.wrap(torch.ones(2, 3), "batch seq")          # a plan for these names
    with pytest.raises(ValueError, match="has 3 dimensions but 2 names"):
        fpp.wrap(torch.ones(2, 3, 4), "batch seq")


class _Ops(TorchDispatchMode):
    """The aten ops that compute (views, which move no data, are not counted)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket is not torch.ops.aten._unsafe_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_token_bookkeeping_of_a_step_takes_a_few_ops():
    """The ids check (clamp, compare, any), the labels check (clamp, compare, where, compare,
    any), the loss's token count and a single micro-batch's weight and count are a handful of
    torch ops (docs/eager_overhead.md), with the same results."""
    from functional_pp.ops.token_ids import check_ids, deferred_checks
    from functional_pp.step.device_step import micro_weights
    step, _ = _step()
    b = _batch()
    labels = b["labels"].clone()
    labels[0, :3] = fpp.ops.IGNORE_INDEX
    with fpp.use_rules(step.rules), deferred_checks() as pending:
        with _Ops() as ids_ops:
            ids = check_ids(b["tokens"], CFG.vocab, "embed", ("batch", "seq"))
        with _Ops() as label_ops:
            checked = check_ids(labels, CFG.vocab, "cross_entropy", ("batch", "seq"), fpp.ops.IGNORE_INDEX)
        with _Ops() as weight_ops:
            (w,), tokens = micro_weights([{"tokens": b["tokens"], "labels": labels}], step.batch_dims)
        logits = fpp.named(torch.randn(2, 8, CFG.vocab), "batch seq vocab")
        with _Ops() as loss_ops:
            loss = fpp.ops.cross_entropy(logits, fpp.named(labels, "batch seq"))
    assert torch.equal(ids, b["tokens"]) and torch.equal(checked, labels) and not any(s[0] for s, _ in pending)
    assert len(ids_ops.ops) <= 3 and len(label_ops.ops) <= 5, (ids_ops.ops, label_ops.ops)
    assert float(tokens) == 13 and float(w) == 1.0 and len(weight_ops.ops) <= 4, weight_ops.ops
    # the check (5), the loss (valid, clamp, logsumexp, gather, sub, mask; its backward is
    # written out: ops/xent/rows.py), the count (2), the sum and the division
    assert len(loss_ops.ops) <= 15, " ".join(loss_ops.ops)
    expected = torch.nn.functional.cross_entropy(logits.data.reshape(-1, CFG.vocab), labels.reshape(-1),
                                                 reduction="sum") / 13
    torch.testing.assert_close(loss.data, expected)


def _update_phase_ops(monkeypatch, step, state) -> list[str]:
    """The computing ops of a warm step's update phase (``finish_update``: the norm, the guard,
    the bound, the optimizer, the metrics)."""
    device_step = importlib.import_module("functional_pp.step.device_step")
    seen = []
    original = device_step.finish_update

    def counted(*a, **k):
        with _Ops() as mode:
            out = original(*a, **k)
        seen.append(mode.ops)
        return out
    monkeypatch.setattr(device_step, "finish_update", counted)
    step(state, _batch(2))
    return seen[-1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_in_place_update_phase_takes_a_bounded_number_of_ops(monkeypatch, precision):
    """Eager, donated AdamW with clipping and a constant rate: the gradient norm, whether loss and
    norm are not finite (2 ops each), the pre-update bound (its rate checks on the host), one
    fused kernel and the metrics' stack are about sixty ops, most on 0-dim values, however many
    leaves (docs/eager_overhead.md "The update phase"; 81 before issue 38's cuts, then 72, now 64)."""
    step, state = _step(precision=precision, donate_state=True)
    state, _ = step(state, _batch(1))
    ops = _update_phase_ops(monkeypatch, step, state)
    assert ops.count("_fused_adamw_") == 1
    assert ops.count("isfinite") == 0 and ops.count("abs") == 0, "loss and norm checked as x - x != 0"
    assert ops.count("clamp") <= 1, "a constant rate's checks made on the host (the clipping's clamp only)"
    assert ops.count("bitwise_not") <= 3, "the flags are kept as 'not finite': no negation of each"
    assert ops.count("where") <= 1 and ops.count("ones_like") == 0, "a held step's clipping factor: one masked_fill"
    assert len(ops) <= 64, " ".join(ops)


def test_a_step_flattens_the_parameter_and_state_trees_a_few_times(monkeypatch):
    """The eager donated step flattens the parameters once in the call and once on the device
    (the leaves passed on from there) and the two moment trees once each: four whole-tree flattens
    a step, where it made fourteen (docs/eager_overhead.md, "Issue 38")."""
    step, state = _step(donate_state=True)
    state, _ = step(state, _batch(1))
    n_params = len(optree.tree_leaves(state["params"]))
    seen, leaves = [], optree.tree_leaves
    for name in ("tree_leaves", "tree_flatten", "tree_iter", "tree_map", "tree_flatten_with_path"):
        original = getattr(optree, name)

        def counted(tree, *a, _o=original, _n=name, **k):
            if len(leaves(tree, none_is_leaf=False)) >= n_params:   # (a whole tree, not a few values)
                seen.append(_n)
            return _o(tree, *a, **k)
        monkeypatch.setattr(optree, name, counted)
    step(state, _batch(2))
    assert len(seen) <= 4, seen


def test_the_bound_derives_its_dtype_margins_once(monkeypatch):
    """The AdamW bound's margin (``torch.finfo`` per dtype) is derived once per set of dtypes, not per
    leaf and step."""
    bounds = importlib.import_module("functional_pp.optim.bounds")
    bounds._PER_DTYPES.clear()
    calls = []
    original = bounds._margin
    monkeypatch.setattr(bounds, "_margin", lambda dtypes: calls.append(dtypes) or original(dtypes))
    step, state = _step(donate_state=True)
    for seed in range(3):
        state, _ = step(state, _batch(seed))
    assert calls == [frozenset({torch.float32})]


def test_the_fused_adamw_plan_is_derived_once_per_state(monkeypatch):
    """The in-place AdamW's per-leaf plan (whether its kernel applies to the parameters and
    moments, its groups) is derived at a state's first step and kept while the step is given the
    very tensors (a donated state); another state's tensors derive it again."""
    fused = importlib.import_module("functional_pp.optim.fused")
    calls = []
    original = fused._states_fit
    monkeypatch.setattr(fused, "_states_fit", lambda *a: calls.append(1) or original(*a))
    step, state = _step(donate_state=True)
    for seed in range(3):
        state, m = step(state, _batch(seed))
        assert m["skipped"] == 0
    assert len(calls) == 1
    other = step.init(fpp.init(llama.init, CFG, seed=1))
    other, m = step(other, _batch(0))
    assert len(calls) == 2 and m["skipped"] == 0


def test_is_tracing_reads_the_thread_local_without_a_failed_lookup(monkeypatch):
    """``is_tracing`` (about 90 calls an eager step) reads its thread-local flag from the thread's
    own dict: a ``getattr`` with a default on a ``threading.local`` raised and caught an
    AttributeError on every call outside ``traced_natively`` (docs/eager_overhead.md)."""
    import threading

    torch_internals = importlib.import_module("functional_pp._torch")
    misses = []

    class Counted(threading.local):
        def __getattr__(self, name):      # called only where the normal lookup failed
            misses.append(name)
            raise AttributeError(name)
    monkeypatch.setattr(torch_internals, "_native", Counted())
    step, state = _step()
    state, _ = step(state, _batch(1))
    assert not torch_internals.is_tracing()
    with torch_internals.traced_natively():
        assert torch_internals.is_tracing()
    assert not torch_internals.is_tracing()
    assert misses == []


def test_an_eager_step_looks_for_no_grad_seed_device(monkeypatch):
    """The compiled step's gradient seed (``grad_seed``) is made on the parameters' device; an eager
    step has none, so it does not look the device up (a walk to the first parameter leaf)."""
    train = importlib.import_module("functional_pp.step.train")
    step, state = _step()
    calls = []
    original = train.device_of
    monkeypatch.setattr(train, "device_of", lambda tree: calls.append(1) or original(tree))
    state, _ = step(state, _batch(1))
    assert calls == []
