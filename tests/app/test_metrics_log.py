"""Metrics loggers behind one protocol: JSONL always, TensorBoard and Weights & Biases (offline)
with the real packages, from a short training run with a held-out set."""
import io
import json
import os

import pytest

from functional_pp.app.loop import train
from functional_pp.app.metrics import JsonlLogger, MultiLogger
from functional_pp.app.world import peak_flops, select_device
from functional_pp.config import TrainConfig

RUN = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "max_steps": 4,
       "warmup_steps": 0, "model": "tiny", "data": {"max_bytes": 60_000}, "val_set_size": 0.1,
       "eval_steps": 2, "logging": {"log_every": 1}, "checkpoint": {"save_final": False}}


def test_jsonl_logger_and_fan_out(tmp_path):
    a, b = JsonlLogger(tmp_path / "a.jsonl"), JsonlLogger(tmp_path / "b.jsonl")
    multi = MultiLogger([a, b])
    multi.log(3, {"loss": 1.5})
    multi.close()
    for f in ("a.jsonl", "b.jsonl"):
        assert json.loads((tmp_path / f).read_text()) == {"loss": 1.5, "step": 3}


def test_tensorboard_and_wandb_offline_receive_train_and_eval_metrics(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    cfg = TrainConfig.from_dict({**RUN, "use_tensorboard": True, "wandb_project": "fpp-test",
                                 "wandb_mode": "offline", "logging": {"output_dir": str(out), "log_every": 1}})
    text = io.StringIO()
    train(cfg, stream=text)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in lines if "eval_loss" in m]
    assert [m["step"] for m in evals] == [0, 2, 4] and "eval " in text.getvalue()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("eval/loss")] == [0, 2, 4]
    assert acc.Scalars("eval/loss")[-1].value == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert wandb.run is None                                       # finished


def test_missing_logger_package_is_a_config_error(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "wandb", None)          # an import of wandb fails
    from functional_pp.config import ConfigError
    cfg = TrainConfig.from_dict({**RUN, "wandb_project": "p", "logging": {"output_dir": str(tmp_path / "r")}})
    with pytest.raises(ConfigError, match=r"wandb_project needs the 'wandb' package, which is not installed: "
                                          r"pip install 'functional_pp\[wandb\]'"):
        train(cfg, stream=io.StringIO())


def test_device_selection_and_peak_flops():
    import torch
    assert select_device(True, 1, False, cuda_available=True) == torch.device("cuda", 0)
    assert select_device(True, 4, False, cuda_available=True) is None      # simulated mesh: CPU
    assert select_device(True, 1, False, cuda_available=False) is None
    assert select_device(False, 8, True, cuda_available=True).type == "cuda"
    assert peak_flops(None, "NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops(None, "NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops(None, "Some CPU") is None and peak_flops(None) is None


def test_resume_is_marked_and_num_epochs_sets_the_steps(tmp_path):
    from functional_pp.app.metrics import read_metrics
    out = tmp_path / "run"
    d = {**RUN, "logging": {"output_dir": str(out), "log_every": 1}, "max_steps": 4}
    train(TrainConfig.from_dict(d), stop_after=2, stream=io.StringIO())
    r = train(TrainConfig.from_dict(d), resume=True, stream=io.StringIO())
    assert r.start_step == 2 and r.final_step == 4
    lines = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3, 4]
    assert [m.get("resumed_from") for m in lines if "loss" in m] == [None, None, 2, None]
    assert (out / "loss.png").is_file()
    cfg = TrainConfig.from_dict({"num_epochs": 2})
    cfg.set_epochs(7)
    assert cfg.max_steps == 14
    both = TrainConfig.from_dict({"num_epochs": 2, "max_steps": 5})
    both.set_epochs(7)
    assert both.max_steps == 5                                     # max_steps wins (Axolotl)


def test_window_averages_say_so_and_an_older_runs_names_are_read_as_today(tmp_path):
    """metrics.jsonl names the window averages (``*_avg``, ``window_steps``); a run of 0.2.0
    (``step_time_s``, ``tokens_per_s``, ``mfu``, ``timed_steps``) resumed into the same
    directory reads back in today's names, its lines and the new ones alike."""
    from functional_pp.app.metrics import read_metrics
    out = tmp_path / "run"
    d = {**RUN, "logging": {"output_dir": str(out), "log_every": 1}, "max_steps": 3}
    train(TrainConfig.from_dict(d), stop_after=2, stream=io.StringIO())
    path = out / "metrics.jsonl"
    written = [json.loads(x) for x in path.read_text().splitlines()]
    assert all({"step_time_avg_s", "tokens_per_s_avg", "window_steps"} <= set(m) for m in written if "loss" in m)
    assert not any({"step_time_s", "tokens_per_s", "timed_steps"} & set(m) for m in written)
    old = {"step_time_avg_s": "step_time_s", "tokens_per_s_avg": "tokens_per_s", "window_steps": "timed_steps",
           "mfu_avg": "mfu"}
    path.write_text("".join(json.dumps({old.get(k, k): v for k, v in m.items()}) + "\n" for m in written))
    train(TrainConfig.from_dict(d), resume=True, stream=io.StringIO())
    lines = [m for m in read_metrics(path) if "loss" in m]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all({"step_time_avg_s", "tokens_per_s_avg", "window_steps"} <= set(m) for m in lines)
    assert lines[0]["step_time_avg_s"] == written[[m.get("step") for m in written].index(1)]["step_time_avg_s"]
    assert not any({"step_time_s", "tokens_per_s", "timed_steps"} & set(m) for m in lines)


def test_progress_line_shows_eval_lr_grad_norm_mfu_and_elapsed():
    from functional_pp.app.progress import Progress
    p = Progress(total=10, stream=io.StringIO(), tty=False)
    p.update(1, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s_avg": 100.0, "mfu_avg": 0.123,
                 "eval_loss": 1.75})
    p.update(2, {"loss": 1.9, "tokens_per_s_avg": 200.0})
    p.update(3, {"loss": 1.8, "tokens_per_s_avg": 100.0})
    line = p.line(3, {"loss": 1.8, "lr": 1e-3, "grad_norm": 0.5, "mfu_avg": 0.123})
    for part in ("loss 1.8000", "eval 1.7500", "lr 1.00e-03", "gnorm 0.5", "MFU 12.3%", "elapsed"):
        assert part in line, part
    assert "190 tok/s" in line                     # smoothed: 0.9 x 200 + 0.1 x 100


def test_resume_after_a_partial_metrics_line_drops_it_and_says_so(tmp_path):
    """A run killed while writing a metrics line leaves it cut; resuming used to stop on it with a
    JSON error (issue 46). The cut line is dropped and named; the resumed lines follow the saved
    steps and equal an uninterrupted run's."""
    def run(out, **kw):
        cfg = TrainConfig.from_dict({**RUN, "max_steps": 3, "val_set_size": 0,
                                     "logging": {"output_dir": str(out), "log_every": 1, "plot": False}})
        text = io.StringIO()
        train(cfg, stream=text, **kw)
        return text.getvalue(), [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    _, whole = run(tmp_path / "whole")
    run(tmp_path / "cut", stop_after=2)                        # stopped with a checkpoint at step 2
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"loss": 3.1, "grad_no')                     # then killed while writing step 3's line
    said, lines = run(tmp_path / "cut", resume=True)
    assert "dropped 1 line(s) that were not JSON (line 3: cut when the run stopped" in said
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert [m["loss"] for m in lines] == [m["loss"] for m in whole]


def test_swanlab_offline_receives_the_metrics_and_a_cloud_run_without_login_is_refused(tmp_path, monkeypatch):
    """use_swanlab (Axolotl's SwanLabPlugin): the real swanlab package, offline; its run's log
    calls are recorded as they pass (the run itself logs them), and equal metrics.jsonl's."""
    swanlab = pytest.importorskip("swanlab")
    calls, real_init = [], swanlab.init

    def recording_init(*args, **kwargs):
        run = real_init(*args, **kwargs)
        real_log = run.log
        run.log = lambda data, step=None: (calls.append((step, dict(data))), real_log(data, step=step))[1]
        return run
    monkeypatch.setattr(swanlab, "init", recording_init)
    out = tmp_path / "run"
    cfg = TrainConfig.from_dict({**RUN, "use_swanlab": True, "swanlab_project": "fpp-test", "swanlab_mode": "offline",
                                 "plugins": ["axolotl.integrations.swanlab.SwanLabPlugin"],
                                 "logging": {"output_dir": str(out), "log_every": 1}})
    train(cfg, stream=io.StringIO())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {m["step"]: m["loss"] for m in lines if "loss" in m}
    logged = {step: d["train/loss"] for step, d in calls if "train/loss" in d}
    assert logged == pytest.approx(losses) and len(logged) == 4
    assert [step for step, d in calls if "eval/loss" in d] == [0, 2, 4]
    assert list((out / "swanlab").glob("run-*/run-*.swanlab"))                # the offline run's records
    monkeypatch.setattr(swanlab, "init", real_init)
    monkeypatch.setattr("sys.stdin", io.StringIO())
    from functional_pp.config import ConfigError
    cloud = TrainConfig.from_dict({**RUN, "use_swanlab": True, "logging": {"output_dir": str(tmp_path / "c")}})
    if not os.environ.get("SWANLAB_API_KEY"):
        with pytest.raises(ConfigError, match="use_swanlab: SwanLab did not start .*swanlab_mode: offline"):
            train(cloud, stream=io.StringIO())


def test_missing_swanlab_names_its_extra(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "swanlab", None)
    from functional_pp.config import ConfigError
    cfg = TrainConfig.from_dict({**RUN, "use_swanlab": True, "logging": {"output_dir": str(tmp_path / "r")}})
    with pytest.raises(ConfigError, match=r"use_swanlab needs the 'swanlab' package.*functional_pp\[swanlab\]"):
        train(cfg, stream=io.StringIO())
