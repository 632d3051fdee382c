"""benchmarks/gpu.py: ``--smoke`` runs the whole benchmark on CPU with a tiny model and prints
one JSON line whose numbers are consistent; without a GPU the real run says so."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu  # noqa: E402


@pytest.mark.slow
def test_gpu_benchmark_smoke_prints_one_consistent_json_line():
    # run as a user does, in its own process (no compile state left by other tests)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True,
                         timeout=1200, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])            # the last line is the result
    assert result["matmul_peak_tflops"] > 0
    ref = result["reference"]                                            # bf16 on the device vs CPU fp32
    assert len(ref["cpu_fp32_losses"]) == len(ref["device_bf16_losses"]) == 2 and ref["max_rel_diff"] < 2e-2
    assert ref["cpu_fp32_losses"] != ref["device_bf16_losses"]           # two different runs
    assert result["spec_peak_tflops"] is None                            # CPU: no GPU peak by name
    assert result["functional_compile"] == "step"                        # the whole step compiled by default
    assert set(result["rows"]) == set(gpu.ROWS)
    for name, row in result["rows"].items():
        assert row["first_loss_rel_diff"] < 2e-2                         # same model, same weights
        assert row["model"]["tied"] == gpu.ROWS[name]["tie"]
        sides = ("functional", "plain") + (("functional_eager",) if gpu.ROWS[name]["eager"] else ())
        for side in sides:
            r = row[side]
            assert r["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / r["median_step_s"])
            assert r["mfu"] == pytest.approx(r["tokens_per_s"] * row["flops_per_token"]
                                             / (result["matmul_peak_tflops"] * 1e12))
            assert r["peak_memory_bytes"] is None                        # CPU: not measured
            assert r["mfu_of_spec_peak"] is None
            prof = r["profile"]                                          # one step's aten ops on CPU
            assert prof["kernels"] >= 1 and prof["kernel_ms"] >= 0 and 1 <= len(prof["top"]) <= 8
            assert 0 < prof["busy_ms"] <= prof["span_ms"] and prof["wall_ms"] > 0 and len(prof["gaps"]) <= 5
        assert row["tokens_per_s_ratio"] == pytest.approx(
            row["functional"]["tokens_per_s"] / row["plain"]["tokens_per_s"])


def test_gpu_benchmark_compiles_the_whole_functional_step_unless_told_per_layer(monkeypatch):
    seen = []
    monkeypatch.setattr(gpu.fpp, "train_step", lambda *a, **kw: seen.append(kw["compile"]) or _NoInit())
    for backend, mode in (("inductor", "step"), ("inductor", "per_layer"), ("aot_eager", "per_layer"), (None, "step")):
        gpu.Functional(gpu.llama.Config.tiny(), None, backend, "cpu", mode=mode)
    assert seen == [True, "per_layer", "per_layer:aot_eager", False]
    assert gpu.parse_args(["--smoke"]).functional_compile == "step"


def test_gpu_benchmark_times_a_chunked_loss_side_when_asked(monkeypatch):
    """``--loss-chunks N`` / ``--loss-chunk-bytes N`` adds ``functional_chunked``: the same compiled
    step with the model's ``loss_chunks`` / ``loss_chunk_bytes`` set; without them the row's sides
    are as before."""
    built = []
    monkeypatch.setattr(gpu, "Functional", lambda cfg, params, backend, device, mode="step":
                        built.append((cfg.loss_chunk_bytes, cfg.loss_chunks, backend, mode)))
    monkeypatch.setattr(gpu.fpp, "init", lambda *a, **kw: None)
    cfg = gpu.llama.Config.tiny()
    plain = gpu.side_makers(cfg, gpu.parse_args(["--smoke"]), 32, eager=True)
    assert set(plain) == {"functional", "plain", "functional_eager"}
    makers = gpu.side_makers(cfg, gpu.parse_args(["--smoke", "--loss-chunk-bytes", "4096"]), 32, eager=False)
    assert set(makers) == {"functional", "plain", "functional_chunked"}
    makers["functional"]()
    makers["functional_chunked"]()
    gpu.side_makers(cfg, gpu.parse_args(["--smoke", "--loss-chunks", "8"]), 32, eager=False)["functional_chunked"]()
    assert built == [(cfg.loss_chunk_bytes, cfg.loss_chunks, "aot_eager", "step"), (4096, None, "aot_eager", "step"),
                     (None, 8, "aot_eager", "step")]
    for bad in (["--loss-chunk-bytes", "-1"], ["--loss-chunks", "-1"], ["--loss-chunks", "8", "--loss-chunk-bytes", "64"]):
        with pytest.raises(SystemExit):
            gpu.parse_args(["--smoke", *bad])


class _Event:
    def __init__(self, name, start, end):
        self.name, self.time_range = name, type("Range", (), {"start": start, "end": end,
                                                             "elapsed_us": lambda r: r.end - r.start})()


def test_gpu_benchmark_timeline_is_the_union_of_kernels_and_names_what_the_host_did_in_a_gap():
    """The device's busy time is the union of its kernels' intervals (overlapping kernels on
    two streams count once); the longest idle stretches come first, each with the kernels on
    either side and the innermost host ops covering it (a sync inside ``item``)."""
    kernels = [_Event("gemm", 0, 10), _Event("nccl", 5, 12), _Event("cast", 6, 8), _Event("add", 20, 21), _Event("norm", 51, 60)]
    host = [_Event("aten::item", 20, 52), _Event("cudaStreamSynchronize", 21, 51.5), _Event("aten::mm", 0, 3)]
    t = gpu.timeline(kernels, host, gaps=5)
    assert t["busy_ms"] == pytest.approx((12 + 1 + 9) / 1e3) and t["span_ms"] == pytest.approx(60 / 1e3)
    assert [(g["at_ms"] * 1e3, g["ms"] * 1e3, g["previous"], g["next"]) for g in t["gaps"]] == [
        (pytest.approx(21), pytest.approx(30), "add", "norm"), (pytest.approx(12), pytest.approx(8), "nccl", "add")]
    assert t["gaps"][0]["host"] == ["cudaStreamSynchronize", "aten::item"]
    assert t["gaps"][1]["host"] == []
    assert gpu.timeline([], host, 5) == {"busy_ms": 0.0, "span_ms": 0.0, "gaps": []}


def test_gpu_benchmark_saves_each_side_as_it_finishes(monkeypatch, tmp_path):
    """A lease that runs out mid-row keeps the sides already measured: ``--json`` is rewritten
    after every side, not only after every row, and the sides with a short first step come
    first (the whole-step compile last)."""
    saved = []

    class Runner:
        def step(self, batch):
            return 1.0
    monkeypatch.setattr(gpu, "start_side", lambda make, batch, warmup, device: (
        Runner(), {"first_step_s": 0.0, "losses": [1.0], "peak_memory_bytes": None}))
    monkeypatch.setattr(gpu, "kernel_profile", lambda runner, batch, device: {"kernels": 0})
    args = gpu.parse_args(["--smoke", "--models", "1b", "--json", str(tmp_path / "out.json")])
    out = {"rows": {"1b": {}}}
    gpu.run_row("1b", args, 1.0, None, out["rows"]["1b"],
                lambda: saved.append(sorted(k for k in out["rows"]["1b"] if k in gpu.side_makers(
                    gpu.model_config("1b", args), args, 32, True))))
    assert saved == [["plain"], ["functional_eager", "plain"], ["functional", "functional_eager", "plain"]]
    assert "tokens_per_s_ratio" in out["rows"]["1b"]


class _NoInit:
    def init(self, params):
        return params


def test_gpu_benchmark_without_cuda_says_so(capsys):
    if gpu.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit):
        gpu.parse_args([])
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp_fsdp_benchmark_smoke_prints_ratios_and_equal_first_losses():
    """benchmarks/dp_fsdp_vs_torch.py on 2 gloo processes, tiny model, one timed step."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "dp_fsdp_vs_torch.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script), "--preset", "tiny", "--steps", "1", "--warmup", "1"],
                         capture_output=True, text=True, timeout=1200, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    losses = result["first_loss"]
    assert set(losses) == {"ours_dp_unbucketed", "ours_dp", "ddp", "ours_fsdp_per_weight", "ours_fsdp", "fsdp2"}
    assert max(losses.values()) - min(losses.values()) < 1e-4 * abs(losses["ddp"])
    for ours, theirs in [("ours_dp", "ddp"), ("ours_fsdp", "fsdp2")]:
        ms = result["median_ms"]
        assert result[f"{ours}/{theirs}"] == pytest.approx(ms[ours] / ms[theirs], rel=0.02)
        cpu = result["median_cpu_ms"]     # CPU time of each rank's process, both sides
        assert cpu[ours] > 0 and cpu[theirs] > 0
        assert result[f"{ours}/{theirs} cpu"] == pytest.approx(cpu[ours] / cpu[theirs], rel=0.02)
        mib = result["peak_mib"]          # per-rank peak memory of one more step, both sides
        assert mib[ours] > 0 and mib[theirs] > 0
        assert result[f"{ours}/{theirs} peak memory"] == pytest.approx(mib[ours] / mib[theirs], rel=0.05)


LINK_MS = 20


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_link_benchmark_smoke_prints_equal_losses_and_exposed_link_time():
    """benchmarks/slow_link.py on 2 gloo processes, tiny model, 20 ms per collective."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "slow_link.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script), "--preset", "tiny", "--steps", "1", "--warmup", "2",
                          "--link-ms", str(LINK_MS)], capture_output=True, text=True, timeout=1200, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["median_ms"]) == {"no_prefetch", "prefetch", "no_link"}
    assert len(set(result["collectives"].values())) == 1 and result["collectives"]["prefetch"] > 0
    ms = result["median_ms"]
    assert result["prefetch/no_prefetch"] == pytest.approx(ms["prefetch"] / ms["no_prefetch"], rel=0.02)
    # the link delays what it carries: a step with the link waits for at least the first gather,
    # the last reduce-scatter and the loss's reduction one after another (prefetch hides the
    # rest). A lower bound, which a busy machine cannot break: comparing with the no-link step's
    # wall time flipped there (one timed step each). Without the link the step takes about 40 ms
    # on an idle machine, below the bound
    assert all(ms[k] >= 3 * LINK_MS for k in ("no_prefetch", "prefetch")), ms
