"""The ``functional-pp train`` command: example configs on simulated devices (in process and
as ``python -m functional_pp``), a real 2-process torchrun run equal to its simulation, and
config errors reported before any work."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import functional_pp as fpp
from functional_pp import cli
from functional_pp.models import llama

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def write_config(path: Path, **overrides) -> Path:
    cfg = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "lr_scheduler": "cosine",
           "warmup_steps": 1, "max_steps": 3, "model": "tiny", "data": {"max_bytes": 300_000},
           "logging": {"log_every": 1}}
    cfg.update(overrides)
    path.write_text(yaml.safe_dump(cfg))
    return path


def rank0_shard_numel(mesh, rules) -> int:
    def device():
        params = fpp.init(llama.init, llama.Config.tiny(), mesh=mesh, rules=rules, seed=0)
        return sum(x.data.numel() for _, x in fpp.leaves_with_paths(params))
    return fpp.launch(device, mesh)[0]


# --------------------------------------------------------------------------- runs
def test_16_device_example_trains_in_process_and_equals_one_device(tmp_path, capsys):
    out4d, out1 = tmp_path / "4d", tmp_path / "single"
    short = ["--max-steps", "3", "--set", "warmup_steps=1"]
    assert cli.main(["train", str(CONFIGS / "4d.yaml"), *short, "--output", str(out4d)]) == 0
    printed = capsys.readouterr().out
    assert cli.main(["train", str(CONFIGS / "single.yaml"), *short, "--output", str(out1)]) == 0

    # start-of-run report: mesh, rules, parameter count, per-device parameter memory
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2, cp=2, tp=2)
    local = rank0_shard_numel(mesh, llama.default_rules(sequence_parallel=True))
    total = fpp.count_params(llama.init(llama.Config.tiny()))
    assert "dp_replicate=2 x dp_shard=2 x cp=2 x tp=2 = 16 devices" in printed
    assert "hidden=dp_shard+cp" in printed and "res_seq=cp+tp" in printed
    assert f"{total:,} parameters" in printed
    assert f"{local:,} parameters on each device x 16 B" in printed
    assert local < total / 4                                   # really sharded
    assert "step 3/3" in printed and "loss curve:" in printed

    # metrics.jsonl: one line per step with the step's metrics; same training as one device
    lines = [json.loads(x) for x in (out4d / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert {"loss", "grad_norm", "lr", "tokens", "tokens_per_s_avg", "step_time_avg_s"} <= set(lines[0])
    assert lines[0]["tokens"] == 16 * 64                       # global_batch_size x sequence_len
    assert lines[-1]["loss"] < lines[0]["loss"]
    for a, b in zip(losses(out4d), losses(out1)):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert (out4d / "loss.png").read_bytes()[:8] == PNG_MAGIC

    # the communication of one step, per mesh axis, as rank 0 saw it
    report = (out4d / "comm_report.txt").read_text()
    assert "communication of training step 1" in report and report.strip() in printed
    rows = {tuple(line.split()[:2]) for line in report.splitlines()[3:]}
    assert ("dp_replicate", "all_reduce") in rows               # HSDP gradient all-reduce
    assert ("dp_shard+cp", "all_gather") in rows and ("dp_shard+cp", "reduce_scatter") in rows
    assert ("cp", "permute") in rows                            # ring attention
    assert any(r[0] == "tp" for r in rows)
    assert (out4d / "checkpoints" / "step-000003" / "index.json").is_file()


def test_python_dash_m_functional_pp_train(tmp_path):
    out = tmp_path / "dp"
    proc = subprocess.run([sys.executable, "-m", "functional_pp", "train", str(CONFIGS / "dp.yaml"),
                           "--max-steps", "2", "--output", str(out), "--set", "logging.log_every=1",
                           "--set", "warmup_steps=0"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "dp_replicate=2 x dp_shard=1 x cp=1 x tp=1 = 2 devices" in proc.stdout
    assert "step 1/2" in proc.stdout and "step 2/2" in proc.stdout   # one line per step off a TTY
    assert "\r" not in proc.stdout
    assert len(losses(out)) == 2
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_precision_compile_and_remat_flags_reach_the_step(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", max_steps=2)
    runs = {"fp32": [], "bf16-compiled": ["--set", "bf16=true", "--set", "compile=aot_eager"],
            "remat": ["--set", "activation_checkpointing=true"]}
    try:
        for name, flags in runs.items():
            assert cli.main(["train", str(cfg), "--output", str(tmp_path / name), *flags]) == 0
    finally:
        torch._dynamo.reset()          # compiled graphs hold tensors that other tests count
    ref = losses(tmp_path / "fp32")
    assert losses(tmp_path / "remat") == ref                     # recomputation changes nothing
    low = losses(tmp_path / "bf16-compiled")
    assert low != ref and all(abs(a - b) < 2e-2 * b for a, b in zip(low, ref))


def test_5d_pipeline_example_equals_one_device(tmp_path, capsys):
    """pp 2 x dp_shard 2 x cp 2 x tp 2 on 16 simulated devices: the losses of the same config
    with every size 1 (examples/configs/5d.yaml)."""
    short = ["--max-steps", "2", "--set", "warmup_steps=0", "--set", "logging.plot=false"]
    ones = [a for k in ("pp_size", "dp_shard_size", "cp_size", "tp_size") for a in ("--set", f"{k}=1")]
    assert cli.main(["train", str(CONFIGS / "5d.yaml"), *short, "--output", str(tmp_path / "5d")]) == 0
    assert "pp=2 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=2 = 16 devices" in capsys.readouterr().out
    assert cli.main(["train", str(CONFIGS / "5d.yaml"), *short, *ones, "--output", str(tmp_path / "one")]) == 0
    five, one = losses(tmp_path / "5d"), losses(tmp_path / "one")
    assert len(five) == 2 and five[1] < five[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(five, one))
    rows = {tuple(line.split()[:2]) for line in (tmp_path / "5d" / "comm_report.txt").read_text().splitlines()[3:]}
    assert ("pp", "permute") in rows and ("cp", "permute") in rows        # stage to stage, ring attention


@pytest.mark.multiprocess
def test_torchrun_pipeline_on_two_gloo_processes_equals_simulation(tmp_path):
    cfg = write_config(tmp_path / "pp.yaml", pp_size=2, micro_batch_size=1, gradient_accumulation_steps=2,
                       max_steps=2, model={"preset": "tiny", "layers": 2}, data={"max_bytes": 60_000},
                       logging={"log_every": 1, "plot": False})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "functional_pp", "train", str(cfg),
                           "--output", str(tmp_path / "torchrun")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert cli.main(["train", str(cfg), "--simulate", "2", "--output", str(tmp_path / "sim")]) == 0
    real, simulated = losses(tmp_path / "torchrun"), losses(tmp_path / "sim")
    assert len(real) == 2 and real == simulated                  # bitwise
    # the checkpoint holds every layer whichever rank held it
    from functional_pp.checkpoint import load_checkpoint
    tree = load_checkpoint(tmp_path / "torchrun" / "checkpoints", keys=["params"]).tree["params"]
    held = {p.split(".")[1] for p, x in fpp.leaves_with_paths(tree) if p.startswith("layers.") and x.numel()}
    assert held == {"0", "1"}
    # ... each written by its own stage's rank (per-stage writes)
    from functional_pp.checkpoint.format import latest_checkpoint, rank_file, read_index
    index = read_index(latest_checkpoint(tmp_path / "torchrun" / "checkpoints"))
    for path, t in index["tensors"].items():
        if ".layers." in f".{path}":
            assert {c["file"] for c in t["chunks"]} == {rank_file(int(path.split("layers.")[1][0]))}, path


@pytest.mark.multiprocess
def test_torchrun_two_gloo_processes_equal_two_simulated_devices(tmp_path):
    cfg = write_config(tmp_path / "fsdp.yaml", dp_shard_size=2, max_steps=3)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "functional_pp", "train", str(cfg),
                           "--output", str(tmp_path / "torchrun")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("torchrun (WORLD_SIZE=2)") == 1   # only rank 0 prints
    assert cli.main(["train", str(cfg), "--simulate", "2", "--output", str(tmp_path / "sim")]) == 0
    real, simulated = losses(tmp_path / "torchrun"), losses(tmp_path / "sim")
    assert len(real) == 3 and real == simulated                  # bitwise: 2-way sums commute
    assert (tmp_path / "torchrun" / "loss.png").is_file()
    assert (tmp_path / "torchrun" / "checkpoints" / "step-000003" / "rank-00001.safetensors").is_file()


# --------------------------------------------------------------------------- config errors
def run_error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def test_mesh_size_must_equal_simulated_device_count(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", dp_shard_size=2, tp_size=2, cp_size=2,
                       logging={"output_dir": str(tmp_path / "out")})
    err = run_error(capsys, ["train", str(cfg), "--simulate", "4"])
    assert "the mesh needs 8 devices" in err and "--simulate 4 gives 4" in err
    assert "dp_replicate_size=1 x dp_shard_size=2 x cp_size=2 x tp_size=2 = 8" in err
    assert not (tmp_path / "out").exists()                    # nothing was done


def test_mesh_size_must_equal_torchrun_world_size(tmp_path, capsys, monkeypatch):
    cfg = write_config(tmp_path / "c.yaml", tp_size=2, logging={"output_dir": str(tmp_path / "out")})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    err = run_error(capsys, ["train", str(cfg)])
    assert "the mesh needs 2 devices" in err and "torchrun (WORLD_SIZE=4) gives 4" in err
    assert "tp_size=2" in err
    err = run_error(capsys, ["train", str(cfg), "--simulate", "2"])
    assert "--simulate 2: RANK=0, WORLD_SIZE=4, MASTER_ADDR=127.0.0.1" in err and "unset RANK WORLD_SIZE" in err
    assert not (tmp_path / "out").exists()


def test_global_batch_not_divisible(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", dp_shard_size=2, micro_batch_size=2, global_batch_size=6)
    err = run_error(capsys, ["train", str(cfg)])
    assert "global_batch_size=6 is not divisible by micro_batch_size x dp = 2 x 2 = 4" in err
    cfg = write_config(tmp_path / "c.yaml", dp_shard_size=2, micro_batch_size=2, global_batch_size=8,
                       gradient_accumulation_steps=3)
    err = run_error(capsys, ["train", str(cfg)])
    assert "global_batch_size=8 != micro_batch_size x gradient_accumulation_steps x dp" in err


def test_sequence_len_not_divisible_by_twice_cp(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", cp_size=4, sequence_len=20)
    err = run_error(capsys, ["train", str(cfg)])
    assert "sequence_len=20 is not divisible by 2 x cp_size = 8" in err


def test_unknown_keys_suggest_the_closest(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", learning_rat=1e-3)
    err = run_error(capsys, ["train", str(cfg)])
    assert "unknown key 'learning_rat'; did you mean 'learning_rate'?" in err
    cfg = write_config(tmp_path / "c.yaml", checkpoint={"save_evry": 3})
    assert "unknown key 'checkpoint.save_evry'; did you mean 'save_every'?" in run_error(capsys, ["train", str(cfg)])
    cfg = write_config(tmp_path / "c.yaml")
    err = run_error(capsys, ["train", str(cfg), "--set", "tp_sise=2"])
    assert "unknown key 'tp_sise'; did you mean 'tp_size'?" in err
    err = run_error(capsys, ["train", str(cfg), "--set", "model.hiden=32"])
    assert "unknown key 'model.hiden'; did you mean 'hidden'?" in err


def test_missing_data_path_is_named(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", data={"path": str(tmp_path / "no_such_corpus.txt")},
                       logging={"output_dir": str(tmp_path / "out")})
    err = run_error(capsys, ["train", str(cfg)])
    assert "data.path" in err and "no_such_corpus.txt" in err and "does not exist" in err
    assert not (tmp_path / "out").exists()


def test_model_dimensions_must_divide_by_their_mesh_axes(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", tp_size=4)           # tiny has kv_heads=2
    err = run_error(capsys, ["train", str(cfg)])
    assert "kv_heads" in err and "not divisible" in err and "tp=4" in err


def test_existing_checkpoints_need_resume(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", max_steps=1, logging={"output_dir": str(tmp_path / "out")})
    assert cli.main(["train", str(cfg)]) == 0
    err = run_error(capsys, ["train", str(cfg)])
    assert "already holds checkpoints (newest: step 1)" in err and "--resume" in err


def test_missing_config_file(tmp_path, capsys):
    err = run_error(capsys, ["train", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in err and "does not exist" in err


@pytest.mark.slow
def test_torchrun_resume_is_bit_exact(tmp_path):
    """On real gloo processes: 4 steps straight == 2 steps, then --resume to 4."""
    cfg = write_config(tmp_path / "fsdp.yaml", dp_shard_size=2, max_steps=4, lr_scheduler="constant",
                       checkpoint={"save_every": 2})

    def torchrun(out, *extra):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", "2", "-m", "functional_pp", "train", str(cfg),
                               "--output", str(out), *extra],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    torchrun(tmp_path / "full")
    torchrun(tmp_path / "split", "--max-steps", "2")
    torchrun(tmp_path / "split", "--resume")
    assert len(losses(tmp_path / "full")) == 4
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
