"""``train_step(..., metrics="deferred")`` (docs/eager_overhead.md "Host synchronisation"): no
step reads the device; the metrics of every unread step come back in one transfer at the read,
skipped steps are chosen on the device, and the host checks raise at the read naming the
first offending step. The per-step mode is the oracle: same states, same metrics."""
from __future__ import annotations

import functools
import io
import math
import pickle
import re
import sys
import warnings
from pathlib import Path

import optree
import pytest
import torch
from host_reads import HostReads, transfers  # noqa: F401 (a fixture)

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.ops.token_ids import TokenIdError
from functional_pp.step import deferred_metrics
from functional_pp.step.nonfinite import NonFiniteError

CFG = llama.Config(vocab=64, hidden=16, layers=2, heads=2, kv_heads=1, mlp=32, max_seq=16,
                   tie_embeddings=False, rope_scaling=None)
NAN_TOKEN = 7            # a batch whose first token is this one has a NaN loss (traceable)
HOST_KEYS = ("step_time_avg_s", "window_steps", "tokens_per_s_avg", "peak_memory_bytes")   # window: steps read


def _loss(params, batch):
    loss = llama.loss(params, batch, cfg=CFG)
    return loss * fpp.wrap(torch.where(batch["tokens"].data[0, 0] == NAN_TOKEN, float("nan"), 1.0), "")


def _batches(n: int, nan_at=(), bad_id_at=()) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        ids = torch.randint(0, CFG.vocab, (2, 9), generator=g)
        ids[0, 0] = NAN_TOKEN if i in nan_at else NAN_TOKEN + 1
        if i in bad_id_at:
            ids[1, 4] = CFG.vocab + 5          # a token id (and a label) outside the vocabulary
        out.append({"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def _step(mode: str, opt=None, **options):
    step = fpp.train_step(_loss, opt or fpp.optim.adamw(1e-2, weight_decay=0.1, clip_norm=1.0), metrics=mode,
                          **options)
    return step, step.init(fpp.init(llama.init, CFG, seed=0))


def _run(mode: str, batches: list[dict], **options):
    """The states after each step and the metrics (read at the end in deferred mode)."""
    step, state = _step(mode, **options)
    states, metrics = [], []
    for b in batches:
        state, m = step(state, b)
        states.append(optree.tree_map(torch.clone, (state["params"], state["opt_state"])))
        metrics.append(m)
    step.read()
    return states, [dict(m) for m in metrics], state


@pytest.fixture
def fresh_dynamo():
    """Compiled steps' graphs dropped afterwards: each TrainStep adds a cache entry to
    ``_device_step``'s code, and dynamo allows only a few per code object."""
    yield
    torch._dynamo.reset()


def _same_metrics(a: dict, b: dict) -> bool:
    keys = set(a) - set(HOST_KEYS)
    return keys == set(b) - set(HOST_KEYS) and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in keys)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True))


@pytest.mark.parametrize("mode,reads_per_step", [("per_step", 1), ("deferred", 0)])
@pytest.mark.parametrize("donate_state", [False, True], ids=["new-buffers", "donated"])
def test_deferred_steps_read_nothing_until_the_one_read(transfers, mode, reads_per_step, donate_state):
    step, state = _step(mode, donate_state=donate_state)
    batches = _batches(4, nan_at=(2,))
    state, _ = step(state, batches[0])        # warm: plans and memos built
    step.read()
    del transfers[:]
    metrics = []
    with HostReads() as mode_reads:
        for b in batches[1:]:                  # one of them skipped: chosen without a read too
            state, m = step(state, b)
            metrics.append(m)
    assert mode_reads.reads == []
    assert transfers == ["tolist"] * (3 * reads_per_step)
    if mode == "deferred":
        assert all(m.pending for m in metrics)
    with HostReads() as mode_reads:
        assert metrics[1]["skipped"] == 1 and metrics[1]["step"] == 3    # any value reads every pending step
        assert [m["skipped"] for m in metrics] == [0, 1, 0]
        step.read()                            # nothing left to read
    assert mode_reads.reads == []
    assert transfers == ["tolist"] * (3 * reads_per_step + (1 - reads_per_step))


@pytest.mark.parametrize("options", [
    pytest.param({}, id="eager"), pytest.param({"donate_state": True}, id="eager-donated"),
    pytest.param({"compile": "aot_eager"}, id="aot_eager", marks=pytest.mark.slow),
    pytest.param({"compile": "aot_eager", "donate_state": True}, id="aot_eager-donated", marks=pytest.mark.slow)])
def test_deferred_and_per_step_runs_agree_and_a_nonfinite_step_is_skipped_on_the_device(options, fresh_dynamo):
    batches = _batches(4, nan_at=(1,))
    per_step, m_per_step, _ = _run("per_step", batches, **options)
    deferred, m_deferred, last = _run("deferred", batches, **options)
    for i, (a, b) in enumerate(zip(per_step, deferred)):
        assert _equal(a, b), f"state after step {i}"
    assert all(_same_metrics(a, b) for a, b in zip(m_per_step, m_deferred)), (m_per_step, m_deferred)
    assert _equal(deferred[1], deferred[0]), "the skipped step's state is the one before it"
    assert [m["skipped"] for m in m_deferred] == [0, 1, 0, 0]
    assert [m["consecutive_skips"] for m in m_deferred] == [0, 1, 0, 0]
    assert m_deferred[1]["step"] == 2 and m_deferred[1]["nonfinite_loss"] == 1
    assert int(last["skipped"]) == 1 and int(last["step"]) == 4


@pytest.mark.parametrize("donate_state", [True, False], ids=["donated", "new-buffers"])
def test_a_deferred_step_needs_no_more_memory_than_a_per_step_one_but_one_leaf_for_its_selects(donate_state):
    from memtrack import peak_memory
    cfg = llama.Config(vocab=256, hidden=64, layers=1, heads=4, kv_heads=2, mlp=128, max_seq=16,
                       tie_embeddings=False, rope_scaling=None)
    ids = torch.randint(0, cfg.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    peaks = {}
    for mode in ("per_step", "deferred"):
        step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-2), metrics=mode,
                              donate_state=donate_state)
        state = step.init(fpp.init(llama.init, cfg, seed=0))
        state, _ = step(state, batch)                    # warm
        step.read()
        with peak_memory() as peak:
            state, _ = step(state, batch)
        step.read()
        peaks[mode] = peak.bytes
    leaf = max(x.numel() * x.element_size() for x in optree.tree_leaves(state["params"]))   # 64 KiB
    extra = peaks["deferred"] - peaks["per_step"]
    assert extra <= (1024 if donate_state else leaf + 1024), (peaks, leaf)


def test_host_figures_are_filled_at_the_read():
    step, state = _step("deferred", flops_per_token=100.0, peak_flops_per_device=1e9)
    metrics = []
    for b in _batches(3):
        state, m = step(state, b)
        metrics.append(m)
    read = step.read()
    assert read == metrics
    seconds = {m["step_time_avg_s"] for m in metrics}
    assert len(seconds) == 1 and seconds.pop() > 0, "the read's wall time, shared by the steps it read"
    assert all(m["window_steps"] == 3 for m in metrics)        # said to be an average over the 3 steps read
    for m in metrics:
        assert m["tokens_per_s_avg"] == pytest.approx(m["tokens"] / m["step_time_avg_s"])
        assert m["mfu_avg"] == pytest.approx(m["tokens_per_s_avg"] * 100.0 / 1e9)
        assert m["peak_memory_bytes"] > 0


@pytest.mark.parametrize("case", ["raise", "max_consecutive_skips", "bad_token_id", "bad_token_id-donated",
                                  "bad_token_id-grad_accum"])
def test_host_checks_raise_at_the_read_naming_the_first_offending_step(case):
    options, nan_at, bad_id_at, error, first = {
        "raise": ({"on_nonfinite": "raise"}, (1, 2), (), NonFiniteError, "step 1: loss nan"),
        "max_consecutive_skips": ({"max_consecutive_skips": 2}, (1, 2, 3), (), NonFiniteError,
                                  "step 2: 2 consecutive steps were skipped"),
        "bad_token_id": ({}, (), (2, 3), TokenIdError, "step 2: embed: token id 69 at position [batch 1, seq 4]"),
        "bad_token_id-donated": ({"donate_state": True}, (), (2, 3), TokenIdError, "step 2: embed: token id 69"),
        "bad_token_id-grad_accum": ({"grad_accum": 2}, (), (2,), TokenIdError,    # in the second micro-batch
                                    "step 2: embed: token id 69 at position [batch 0, seq 4]"),
    }[case]
    offending = int(first.split(":")[0].split()[1])
    step, state = _step("deferred", **options)
    states, metrics = [], []
    for b in _batches(5, nan_at=nan_at, bad_id_at=bad_id_at):      # no step raises
        state, m = step(state, b)
        states.append(optree.tree_map(torch.clone, (state["params"], state["opt_state"])))
        metrics.append(m)
    with pytest.raises(error, match=re.escape(first)):
        step.read()
    assert _equal(states[offending], states[offending - 1]), "the offending step was skipped on the device"
    assert metrics[offending - 1]["step"] == offending and metrics[offending - 1].error is None
    for m in metrics[offending:]:              # the error again, not values past it
        assert isinstance(m.error, error)
        with pytest.raises(error, match=re.escape(first)):
            m["loss"]
    assert step.read() == []
    assert pickle.loads(pickle.dumps(metrics[0])) == dict(metrics[0])


def test_a_held_in_place_update_is_counted_as_skipped_and_reported_at_the_read():
    # lr 1e30: AdamW's in-place step cannot show its result finite and writes nothing (held);
    # deferred mode does not redo it in new buffers: the step is skipped and reported
    opt = fpp.optim.adamw(1e30, weight_decay=0.1)
    step, state = _step("deferred", opt, donate_state=True, max_consecutive_skips=None)
    before = optree.tree_map(torch.clone, (state["params"], state["opt_state"]))
    state, m = step(state, _batches(1)[0])
    with pytest.warns(RuntimeWarning, match=r"step\(s\) \[0\]: the in-place optimizer update could not be shown"):
        step.read()
    assert (m["update_held"], m["skipped"], m["consecutive_skips"]) == (1, 1, 1)
    assert _equal((state["params"], state["opt_state"]), before)
    raising, state = _step("deferred", opt, donate_state=True, on_nonfinite="raise")
    state, m = raising(state, _batches(1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(NonFiniteError, match="step 0: the in-place optimizer update .* held back"):
            raising.read()


def test_a_device_reads_once_it_holds_the_most_unread_steps(monkeypatch, transfers):
    monkeypatch.setattr(deferred_metrics, "MAX_PENDING_STEPS", 3)
    step, state = _step("deferred")
    metrics = []
    for b in _batches(4):
        state, m = step(state, b)
        metrics.append(m)
    assert [m.pending for m in metrics] == [False, False, False, True]
    assert transfers == ["tolist"]


def test_the_metrics_mode_is_checked():
    with pytest.raises(ValueError, match="metrics 'lazy': choose 'per_step'"):
        fpp.train_step(_loss, fpp.optim.sgd(0.1), metrics="lazy")


def test_the_host_sync_benchmark_trains_both_modes_alike():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import host_sync
    finally:
        sys.path.pop(0)
    r = host_sync.run(steps=4, read_every=2, donate=False)     # (it checks that the losses are equal)
    assert r["steps"] == 4 and r["per_step_cpu_ms"] > 0 and r["deferred_cpu_ms"] > 0
    assert r["ratio_deferred_per_step"] == pytest.approx(r["deferred_cpu_ms"] / r["per_step_cpu_ms"])


def _gloo_runs():
    """On each of 2 processes (dp_shard=2): 3 steps per-step and deferred; then 3 deferred steps
    where only rank 1's block of the second batch holds a bad token id."""
    mesh = fpp.Mesh(dp_shard=2)
    rules = llama.default_rules()
    loss = functools.partial(llama.loss, cfg=CFG)

    def device():
        out = {}
        for mode in ("per_step", "deferred", "bad_id"):
            step = fpp.train_step(loss, fpp.optim.adamw(1e-2, clip_norm=1.0), mesh=mesh, rules=rules,
                                  metrics="per_step" if mode == "per_step" else "deferred", donate_state=True)
            state = step.init(fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=0))
            metrics, error = [], None
            for b in _batches(3, bad_id_at=(1,) if mode == "bad_id" else ()):   # the bad row is rank 1's
                with fpp.use_rules(rules):
                    local = {k: fpp.named(v, "batch seq").data for k, v in b.items()}
                state, m = step(state, local)
                metrics.append(m)
            try:
                step.read()
            except TokenIdError as exc:
                error = str(exc)
            losses = [m["loss"] if m.get("skipped", 0) == 0 else "skipped" for m in metrics[:1 if error else 3]]
            skipped = [m["skipped"] for m in metrics] if error is None else None
            with fpp.use_rules(rules):
                full = fpp.gather_tree(state["params"], llama.init(CFG), rules)
            out[mode] = (losses, skipped, error, {p: x.numpy() for p, x in fpp.leaves_with_paths(full)})
        return out
    return fpp.launch(device, mesh, processes=True, timeout=120)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_deferred_run_on_two_gloo_processes_equals_the_per_step_run():
    ranks = _gloo_runs()
    for r, out in enumerate(ranks):
        (l_a, _, _, p_a), (l_b, s_b, e_b, p_b) = out["per_step"], out["deferred"]
        assert l_a == l_b and s_b == [0, 0, 0] and e_b is None, r
        assert p_a.keys() == p_b.keys() and all((p_a[k] == p_b[k]).all() for k in p_a), r
    # a bad id on rank 1 only: its NaN gradient reaches every rank, so both skip the step
    (_, skipped0, error0, params0), (_, _, error1, params1) = ranks[0]["bad_id"], ranks[1]["bad_id"]
    assert error0 is None and skipped0 == [0, 1, 0]
    assert error1 is not None and error1.startswith("step 1: embed: token id 69 at position [batch 0, seq 4]")
    assert all((params0[k] == params1[k]).all() for k in params0)


# ----------------------------------------------------------------------------- the trainer loop
LOOP = {"micro_batch_size": 2, "sequence_len": 16, "learning_rate": 3e-3, "max_steps": 5, "model": "tiny",
        "data": {"max_bytes": 100_000}, "logging": {"log_every": 2}}
LOOP_HOST_KEYS = HOST_KEYS + ("mfu_avg", "elapsed_s")


def _train(out, monkeypatch, per_step: bool = False, **overrides):
    from functional_pp.app.loop import train
    from functional_pp.app.metrics import read_metrics
    from functional_pp.config import TrainConfig
    from functional_pp.step import train as train_module
    if per_step:                    # the oracle: the loop with the per-step read
        def per_step_train_step(*args, _original=train_module.train_step, **kw):
            return _original(*args, **{**kw, "metrics": "per_step"})
        monkeypatch.setattr(train_module, "train_step", per_step_train_step)
    cfg = {**LOOP, **overrides}
    cfg["logging"] = {**cfg["logging"], "output_dir": str(out)}
    train(TrainConfig.from_dict(cfg, name="t"), stream=io.StringIO())
    monkeypatch.undo()
    return [{k: v for k, v in m.items() if k not in LOOP_HOST_KEYS} for m in read_metrics(out / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{}, {"dp_shard_size": 2}], ids=["one-device", "fsdp-2-simulated"])
def test_the_trainer_loop_reads_every_log_every_steps_and_logs_what_the_per_step_loop_logs(tmp_path, monkeypatch,
                                                                                            mesh):
    per_step = _train(tmp_path / "per_step", monkeypatch, per_step=True, **mesh)
    reads = []
    original = deferred_metrics.one_transfer

    def counted(scalars):
        values = original(scalars)
        reads.append(len(values))
        return values
    monkeypatch.setattr(deferred_metrics, "one_transfer", counted)
    deferred = _train(tmp_path / "deferred", monkeypatch, **mesh)
    assert [m["step"] for m in deferred] == [1, 2, 3, 4, 5]
    assert deferred == per_step and all(math.isfinite(m["loss"]) for m in deferred)
    per_read = reads[0]                                  # the values of one step
    devices = 1 + bool(mesh)                             # (each device reads its own)
    assert reads == [x for x in [per_read, per_read, 2 * per_read, per_read] for _ in range(devices)], \
        "steps 1, 2, 3-4, 5 read together"


class _BadSecondBatch:
    """A DataLoader whose second batch holds a token id outside the vocabulary."""

    @staticmethod
    def patch(monkeypatch):
        from functional_pp import data
        base = data.DataLoader

        class Loader(base):
            def __next__(self):
                out = super().__next__()
                if self.step == 2:
                    out = {**out, "tokens": out["tokens"].clone()}
                    out["tokens"][0, 3] = 10 ** 6
                return out
        monkeypatch.setattr(data, "DataLoader", Loader)


@pytest.mark.slow
def test_the_trainer_loop_reads_before_a_checkpoint_so_none_holds_a_state_past_an_error(tmp_path, monkeypatch):
    from functional_pp.app.metrics import read_metrics
    _BadSecondBatch.patch(monkeypatch)
    out = tmp_path / "run"
    with pytest.raises(fpp.DeviceError, match=r"TokenIdError: step 1: embed: token id 1000000"):
        _train(out, monkeypatch, max_steps=4, logging={"log_every": 10}, checkpoint={"save_every": 2})
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1], "the step before the error is logged"
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
