"""Axolotl's stopping rules on 2 simulated devices: the loss watchdog stops the run after
loss_watchdog_patience steps above loss_watchdog_threshold, early stopping after
early_stopping_patience evaluations without a lower held-out loss; both save the checkpoint,
say why on stderr and exit with status 4."""
import json
from pathlib import Path

import pytest
import yaml

from functional_pp import cli


def run(tmp_path: Path, capsys, **keys) -> tuple[int, str, list[int]]:
    cfg = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "lr_scheduler": "constant",
           "max_steps": 8, "model": "tiny", "data": {"max_bytes": 100_000}, "logging_steps": 4,
           "output_dir": str(tmp_path / "out"), **keys}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    status = cli.main(["train", str(path), "--simulate", "2"])
    err = capsys.readouterr().err
    steps = [m["step"] for m in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines())
             if "loss" in m]
    return status, err, steps


def test_loss_watchdog_stops_after_patience_steps_above_the_threshold(tmp_path, capsys):
    status, err, steps = run(tmp_path, capsys, loss_watchdog_threshold=0.5, loss_watchdog_patience=2)
    assert status == 4 and steps == [1, 2], (status, err)
    assert "loss watchdog: the loss was above loss_watchdog_threshold=0.5 for 2 steps in a row" in err
    assert "at step 2/8" in err and (tmp_path / "out" / "checkpoints" / "step-000002").is_dir()


def test_loss_watchdog_below_the_loss_never_fires(tmp_path, capsys):
    status, err, steps = run(tmp_path, capsys, loss_watchdog_threshold=1e6, max_steps=3)
    assert status == 0 and steps == [1, 2, 3], err


def test_early_stopping_after_patience_evaluations_without_improvement(tmp_path, capsys):
    # a learning rate below fp32 resolution: the parameters and so the held-out loss stay as at the
    # first evaluation (step 1), never lower
    status, err, steps = run(tmp_path, capsys, learning_rate=1e-20, val_set_size=0.05, eval_steps=1,
                             data={"max_bytes": 20_000},
                             early_stopping_patience=2)
    assert status == 4 and steps == [1, 2, 3], (status, err)
    assert "early stopping: the held-out loss did not improve" in err and "for 2 evaluations" in err


def test_early_stopping_needs_a_held_out_set():
    from functional_pp.config import ConfigError, TrainConfig
    with pytest.raises(ConfigError, match="early_stopping_patience watches the held-out loss"):
        TrainConfig.from_dict({"early_stopping_patience": 2})


@pytest.mark.multiprocess
def test_two_gloo_processes_stop_together_with_axolotl_fsdp_keys(tmp_path):
    """torchrun, 2 real processes: fsdp_config (reshard_after_forward: false) trains on both;
    the loss watchdog stops both ranks at the same step, each writing its checkpoint shard."""
    import os
    import subprocess
    import sys
    cfg = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "max_steps": 8, "model": "tiny",
           "data": {"max_bytes": 100_000}, "logging_steps": 4, "fsdp_version": 2,
           "fsdp_config": {"reshard_after_forward": False, "offload_params": False},
           "loss_watchdog_threshold": 0.5, "loss_watchdog_patience": 2}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "functional_pp", "train", str(path), "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and "loss watchdog: the loss was above" in proc.stderr, proc.stderr[-3000:]
    assert "all 2 devices are data parallel" in proc.stdout
    ckpt = tmp_path / "out" / "checkpoints" / "step-000002"
    assert (ckpt / "rank-00000.safetensors").is_file() and (ckpt / "rank-00001.safetensors").is_file()
    steps = [m["step"] for m in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines())
             if "loss" in m]
    assert steps == [1, 2]
