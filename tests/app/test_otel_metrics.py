"""``use_otel_metrics`` (Axolotl's OpenTelemetry callback): the run's metrics as Axolotl's gauges
and step counter, read here with OpenTelemetry's in-memory reader and, in a run, scraped from the
Prometheus endpoint on ``otel_metrics_host:otel_metrics_port``; without the packages the run
stops at start naming the extra; other ``otel_*`` keys are refused by name."""
import io
import socket
import sys
import urllib.request

import pytest

from functional_pp.app.loop import train
from functional_pp.app.metrics import OtelLogger, read_metrics
from functional_pp.config import ConfigError, TrainConfig

pytest.importorskip("opentelemetry.sdk.metrics")
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402


def exported(reader) -> dict:
    """name -> the last value of each exported metric."""
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = m.data.data_points[-1].value
    return out


def test_the_gauges_are_axolotls():
    reader = InMemoryMetricReader()
    logger = OtelLogger(reader=reader)
    logger.log(1, {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens": 16.0})
    logger.log(2, {"loss": 2.25, "lr": 2e-3, "grad_norm": 0.5})
    logger.log(2, {"eval_loss": 3.0, "eval_accuracy": 0.25})
    got = exported(reader)
    logger.close()
    assert got == {"axolotl_train_loss": 2.25, "axolotl_learning_rate": 2e-3, "axolotl_gradient_norm": 0.5,
                   "axolotl_global_steps": 2, "axolotl_eval_loss": 3.0, "axolotl_eval_accuracy": 0.25}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def config(out, **kw):
    return TrainConfig.from_dict({"dp_shard_size": 1, "micro_batch_size": 2, "sequence_len": 16, "max_steps": 2,
                                  "model": "tiny", "data": {"max_bytes": 20_000}, "use_otel_metrics": True,
                                  "logging": {"log_every": 1, "output_dir": str(out)}, **kw}, name="t")


def test_a_run_serves_its_metrics_to_prometheus(tmp_path):
    port = free_port()
    train(config(tmp_path / "o", otel_metrics_port=port), stream=io.StringIO())
    text = urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=10).read().decode()
    last = [m for m in read_metrics(tmp_path / "o" / "metrics.jsonl") if "loss" in m][-1]
    line = next(x for x in text.splitlines() if x.startswith("axolotl_train_loss"))
    assert float(line.split()[-1]) == pytest.approx(last["loss"], rel=1e-6)


def test_without_the_packages_the_run_stops_at_start_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.metrics", None)
    with pytest.raises(ConfigError, match=r"use_otel_metrics needs .*functional_pp\[otel\]"):
        train(config(tmp_path / "o"), stream=io.StringIO())


def test_an_unknown_otel_key_or_a_bad_port_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="otel_exporter.*this OpenTelemetry option is not supported"):
        config(tmp_path, otel_exporter="otlp")
    with pytest.raises(ConfigError, match="otel_metrics_port must be a port number 0-65535"):
        config(tmp_path, otel_metrics_port=70000)
