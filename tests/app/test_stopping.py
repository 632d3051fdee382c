"""Axolotl's stopping rules on 2 simulated devices: the loss watchdog stops the run after
loss_watchdog_patience steps above loss_watchdog_threshold, early stopping after
early_stopping_patience evaluations without a lower held-out loss; both save the checkpoint,
say why on stderr and exit with status 4."""
import json
from pathlib import Path

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
    status, err, steps = run(tmp_path, capsys, learning_rate=1e-20, val_set_size=0.1, eval_steps=1,
                             early_stopping_patience=2)
    assert status == 4 and steps == [1, 2, 3], (status, err)
    assert "early stopping: the held-out loss did not improve" in err and "for 2 evaluations" in err


def test_early_stopping_needs_a_held_out_set():
    import pytest

    from functional_pp.config import ConfigError, TrainConfig
    with pytest.raises(ConfigError, match="early_stopping_patience watches the held-out loss"):
        TrainConfig.from_dict({"early_stopping_patience": 2})
