"""Metrics loggers behind one small protocol: ``log(step, metrics)`` and ``close()``.

``metrics.jsonl`` (always), TensorBoard (``use_tensorboard: true``, the ``tensorboard``
package), Weights & Biases (``wandb_project``; ``wandb_mode: offline`` needs no network) and SwanLab
(``use_swanlab``; ``swanlab_mode: offline`` needs no network) and OpenTelemetry
(``use_otel_metrics``: Axolotl's gauges, served to Prometheus on ``otel_metrics_host:port``).
The training loop logs training metrics and, at eval steps, ``eval_loss``; :func:`read_metrics`
reads ``metrics.jsonl`` back (``docs/finetune.md``).
"""
from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Protocol

from functional_pp.core.optional import require

__all__ = ["MetricsLogger", "JsonlLogger", "TensorBoardLogger", "WandbLogger", "SwanLabLogger", "OtelLogger", "make_loggers",
           "MultiLogger", "read_metrics", "trim_metrics"]


class MetricsLogger(Protocol):
    """Receives the metrics of each step (numbers), on the main process only."""

    def log(self, step: int, metrics: dict) -> None: ...

    def close(self) -> None: ...


def _numbers(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


class JsonlLogger:
    """One JSON line per ``log`` call (``step`` and the metrics)."""

    def __init__(self, path: Path, append: bool = False):
        self.path = Path(path)
        self.file = open(self.path, "a" if append else "w")

    def log(self, step: int, metrics: dict) -> None:
        self.file.write(json.dumps({**metrics, "step": int(step)}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardLogger:
    """Scalars under ``train/<name>`` (``eval/loss`` for the held-out loss)."""

    def __init__(self, log_dir: Path):
        require("tensorboard", "tensorboard", "use_tensorboard")
        writer = require("torch.utils.tensorboard", "tensorboard", "use_tensorboard").SummaryWriter
        self.writer = writer(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict) -> None:
        for k, v in _numbers(metrics).items():
            tag = "eval/loss" if k == "eval_loss" else f"train/{k}"
            self.writer.add_scalar(tag, v, int(step))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run (``mode="offline"`` writes under ``dir`` and needs no network)."""

    def __init__(self, project: str, run_dir: Path, *, mode: str | None = None, name: str | None = None,
                 entity: str | None = None, config: dict | None = None):
        wandb = require("wandb", "wandb", "wandb_project")
        self.run = wandb.init(project=project, dir=str(run_dir), mode=mode, name=name, entity=entity,
                              config=config, reinit=True)

    def log(self, step: int, metrics: dict) -> None:
        values = _numbers(metrics)
        if "eval_loss" in values:
            values["eval/loss"] = values.pop("eval_loss")
        self.run.log({(k if "/" in k else f"train/{k}"): v for k, v in values.items()}, step=int(step))

    def close(self) -> None:
        self.run.finish()


def _attempt(fn, **kwargs) -> tuple[bool, object]:
    """``(True, fn(**kwargs))``, or ``(False, the exception)``."""
    try:
        return True, fn(**kwargs)
    except Exception as exc:          # (a cloud run without a login, ...): reported before any step
        return False, exc


class SwanLabLogger(WandbLogger):
    """A SwanLab experiment (Axolotl's SwanLabPlugin; ``mode`` offline / local write under
    ``run_dir/swanlab`` and need no network), with W&B's metric names."""

    def __init__(self, project: str, run_dir: Path, *, mode: str | None = None, name: str | None = None,
                 description: str | None = None, workspace: str | None = None, config: dict | None = None):
        swanlab = require("swanlab", "swanlab", "use_swanlab")
        kwargs = dict(project=project, experiment_name=name, description=description, workspace=workspace,
                      mode=mode or "cloud", logdir=str(run_dir / "swanlab"), config=config)
        # started off the main thread: there SwanLab would install its own SIGINT handler, taking
        # Ctrl-C from the run's stop with a checkpoint (app/signals.py), and restore it at finish
        # from whichever thread closes the loggers (a device thread: refused by signal.signal)
        started: list = []
        t = threading.Thread(target=lambda: started.append(_attempt(swanlab.init, **kwargs)), name="swanlab-init")
        t.start()
        t.join()
        ok, value = started[0]
        if ok:
            self.run = value
        else:
            exc = value
            from functional_pp.config import ConfigError
            raise ConfigError(f"use_swanlab: SwanLab did not start ({exc}); log in (swanlab login, or "
                              f"SWANLAB_API_KEY) or set swanlab_mode: offline") from exc


#: our metric -> Axolotl's OpenTelemetry gauge (its OpenTelemetryMetricsCallback's names)
OTEL_GAUGES = {"loss": "axolotl_train_loss", "eval_loss": "axolotl_eval_loss", "lr": "axolotl_learning_rate",
               "epoch": "axolotl_epoch", "grad_norm": "axolotl_gradient_norm"}


class OtelLogger:
    """OpenTelemetry metrics as Axolotl's callback exports them: gauges ``axolotl_train_loss``,
    ``axolotl_eval_loss``, ``axolotl_learning_rate``, ``axolotl_epoch``, ``axolotl_gradient_norm``
    and the counter ``axolotl_global_steps`` (one per logged training step), read by ``reader``
    (default: a Prometheus reader served on ``http://host:port/metrics``, as Axolotl's)."""

    def __init__(self, host: str = "localhost", port: int = 8000, reader=None):
        sdk = require("opentelemetry.sdk.metrics", "otel", "use_otel_metrics")
        if reader is None:
            reader = require("opentelemetry.exporter.prometheus", "otel", "use_otel_metrics").PrometheusMetricReader()
            from functional_pp.config import ConfigError
            try:
                require("prometheus_client", "otel", "use_otel_metrics").start_http_server(int(port), addr=str(host))
            except OSError as exc:
                raise ConfigError(f"use_otel_metrics: the metrics server cannot listen on {host}:{port} ({exc}): "
                                  f"set otel_metrics_host / otel_metrics_port to a free address") from exc
        self.provider = sdk.MeterProvider(metric_readers=[reader])
        meter = self.provider.get_meter("functional_pp.training")
        self.gauges = {k: meter.create_gauge(name=v, unit="1") for k, v in OTEL_GAUGES.items()}
        self.steps = meter.create_counter(name="axolotl_global_steps", unit="1")

    def log(self, step: int, metrics: dict) -> None:
        values = _numbers(metrics)
        for key, value in values.items():
            if key in self.gauges:
                self.gauges[key].set(value)
            elif key.startswith("eval_"):       # other held-out metrics, as Axolotl's on_evaluate
                self.gauges[key] = self.provider.get_meter("functional_pp.training").create_gauge(
                    name=f"axolotl_{key}", unit="1")
                self.gauges[key].set(value)
        if "loss" in values:
            self.steps.add(1)

    def close(self) -> None:
        """Flushed; the Prometheus endpoint keeps serving the last values until the process ends
        (as Axolotl's)."""
        self.provider.force_flush()


class MultiLogger:
    """Sends every call to each logger."""

    def __init__(self, loggers: list):
        self.loggers = loggers

    def log(self, step: int, metrics: dict) -> None:
        for lg in self.loggers:
            lg.log(step, metrics)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def make_loggers(cfg, out_dir: Path, metrics_path: Path, *, append: bool) -> MultiLogger:
    """The loggers the config asks for (JSONL always)."""
    loggers: list = [JsonlLogger(metrics_path, append=append)]
    if cfg.use_tensorboard:
        loggers.append(TensorBoardLogger(out_dir / "tensorboard"))
    if cfg.wandb_project:
        loggers.append(WandbLogger(cfg.wandb_project, out_dir, mode=cfg.wandb_mode,
                                   name=cfg.wandb_name, entity=cfg.wandb_entity, config=cfg.to_dict()))
    if cfg.use_swanlab:
        loggers.append(SwanLabLogger(cfg.swanlab_project or out_dir.name, out_dir, mode=cfg.swanlab_mode,
                                     name=cfg.swanlab_experiment_name, description=cfg.swanlab_description,
                                     workspace=cfg.swanlab_workspace, config=cfg.to_dict()))
    if cfg.use_otel_metrics:
        loggers.append(OtelLogger(cfg.otel_metrics_host, cfg.otel_metrics_port))
    return MultiLogger(loggers)


#: the names before the window averages said so (runs of 0.2.0 and earlier), read as today's
RENAMED = {"step_time_s": "step_time_avg_s", "tokens_per_s": "tokens_per_s_avg", "mfu": "mfu_avg",
           "timed_steps": "window_steps"}


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The lines of a ``metrics.jsonl`` file, an older run's keys renamed (:data:`RENAMED`)."""
    p = Path(path)
    if not p.exists():
        return []
    return [{RENAMED.get(k, k): v for k, v in json.loads(line).items()}
            for line in p.read_text().splitlines() if line.strip()]


def trim_metrics(path: Path, last_step: int) -> list[int]:
    """Keep the lines of steps <= ``last_step`` (a resumed run rewrites the later ones). Lines
    that are not JSON (the partial last line of a run killed while writing it) are dropped;
    returns their line numbers, for the run to say so."""
    if not path.exists():
        return []
    keep, bad = [], []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            bad.append(n)
        elif record.get("step", 0) <= last_step:
            keep.append(line)
    path.write_text("".join(line + "\n" for line in keep))
    return bad
