"""``functional-pp validate --memory``: the start-up report's peak memory comes from the planner's
dry run of the config's own training step (functional_pp/app/report.py, ``planned_memory``),
not from a second memory model."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

from functional_pp import cli, optim, plan
from functional_pp.app.report import human_bytes
from functional_pp.config import TrainConfig, model_config, model_family

CONFIG = {"dp_shard_size": 2, "tp_size": 2, "micro_batch_size": 2, "sequence_len": 32, "model": "tiny",
          "optimizer": "sgd", "momentum": 0.9, "max_grad_norm": None, "lr_scheduler": "constant",
          "data": {"max_bytes": 100_000}}


def peak_line(capsys, path: Path, *extra: str) -> str | None:
    assert cli.main(["validate", str(path), *extra]) == 0
    return next((line for line in capsys.readouterr().out.splitlines() if line.startswith("peak:")), None)


def test_validate_memory_prints_the_dry_run_peak_of_the_configs_step(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    assert peak_line(capsys, path) is None                     # not at every start
    line = peak_line(capsys, path, "--memory")
    cfg = TrainConfig.from_dict(CONFIG)
    mesh = cfg.mesh(4)
    rules = cfg.build_rules(mesh)
    family, model = model_family(cfg), model_config(cfg)
    est = plan.estimate(functools.partial(family.loss, cfg=model), family.param_decls(model), mesh, rules,
                        {"tokens": ((4, 32), "batch seq"), "labels": ((4, 32), "batch seq")},
                        optimizer=optim.sgd(3e-4, momentum=0.9))
    assert line.startswith(f"peak:       {human_bytes(est.peak_bytes)} per device")
    assert f"optimizer state {human_bytes(est.memory['optimizer state'])}" in line   # SGD: one buffer
    remat = peak_line(capsys, path, "--memory", "--set", "activation_checkpointing=true")
    size = re.compile(r"activations ([\d.,]+) KiB")
    assert float(size.search(remat).group(1)) < float(size.search(line).group(1))


def _line(capsys, path: Path, prefix: str, *extra: str) -> str | None:
    assert cli.main(["validate", str(path), *extra]) == 0
    return next((line for line in capsys.readouterr().out.splitlines() if line.startswith(prefix)), None)


def test_validate_memory_counts_the_offload_levers_on_device_and_host(tmp_path, capsys):
    """offload_params and activation_offloading lower the device's peak and print the host's."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**{k: v for k, v in CONFIG.items() if k != "momentum"}, "optimizer": "adamw",
                                    "precision": "bf16"}))
    plain = _line(capsys, path, "peak:", "--memory")
    assert _line(capsys, path, "host:", "--memory") is None
    size = re.compile(r"peak: +([\d.,]+) KiB")
    for lever in ("offload_params", "activation_offloading"):
        peak = _line(capsys, path, "peak:", "--memory", "--set", f"{lever}=true")
        host = _line(capsys, path, "host:", "--memory", "--set", f"{lever}=true")
        assert float(size.search(peak).group(1)) < float(size.search(plain).group(1)), lever
        assert host is not None and lever in host, host
