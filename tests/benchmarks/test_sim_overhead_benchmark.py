"""benchmarks/sim_overhead.py runs and prints ratios consistent with its own timings."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sim_overhead  # noqa: E402


def test_sim_overhead_benchmark_smoke(capsys):
    out = sim_overhead.main(["--devices", "1,2", "--steps", "1", "--repeats", "1", "--warmup", "1",
                             "--batch", "4", "--seq", "16"])
    assert capsys.readouterr().out.strip().startswith("{")
    one, two = out["devices"]["1"], out["devices"]["2"]
    assert out["ratio_cpu"]["2"] == pytest.approx(two["cpu_s"] / one["cpu_s"])
    assert out["ratio_wall"]["1"] == 1.0
    assert one["last_loss"] == pytest.approx(two["last_loss"], rel=1e-5)   # same model, same batch
    # where the time goes: one device's thread time, the part in simulated collectives
    assert one["collectives_cpu_s"] == 0 < two["collectives_cpu_s"] < two["device_cpu_s"]
    assert out["ratio_without_collectives"]["2"] == pytest.approx(
        2 * (two["device_cpu_s"] - two["collectives_cpu_s"]) / one["cpu_s"])


def test_sim_overhead_benchmark_batched_side_by_side(capsys):
    """--batched: the same steps as one batched simulation, next to the threaded ratios, ending
    with bitwise the threaded run's parameters."""
    out = sim_overhead.main(["--devices", "1,4", "--steps", "1", "--repeats", "1", "--warmup", "1",
                             "--batch", "4", "--seq", "16", "--batched"])
    capsys.readouterr()
    batched, one = out["batched"], out["devices"]["1"]
    assert set(batched["ratio_cpu"]) == {"4"} and "4" in out["ratio_cpu"]
    assert batched["ratio_cpu"]["4"] == pytest.approx(batched["devices"]["4"]["cpu_s"] / one["cpu_s"])
    assert batched["same_params"] == {"4": True}
    assert batched["devices"]["4"]["last_loss"] == out["devices"]["4"]["last_loss"]
