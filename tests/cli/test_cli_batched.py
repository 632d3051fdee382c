"""The training loop (``functional-pp train``) on the batched simulator: the same losses,
metrics, communication report and checkpoints (bitwise) as on the threaded simulator, a save
and resume on the batched path, the ``simulation`` key / ``--sim-mode`` choice and its refusal
(docs/simulation.md, "The training loop on the batched simulator")."""
import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.app.host_view import StackedLoader, device_loader, is_lead, lead_value, save_on_devices
from functional_pp.app.loop import train
from functional_pp.app.world import resolve_world
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.data import DataLoader

BASE = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "lr_scheduler": "cosine",
        "warmup_steps": 1, "max_steps": 3, "weight_decay": 0.1, "model": "tiny",
        "data": {"max_bytes": 100_000}, "logging": {"log_every": 1, "plot": False}}


def config(out: Path, simulation: str, **overrides) -> TrainConfig:
    d = {**BASE, "simulation": simulation, **overrides}
    d["logging"] = {**d["logging"], "output_dir": str(out)}
    return TrainConfig.from_dict(d, name="t")


def metrics(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timing = ("elapsed_s", "step_time_avg_s", "tokens_per_s_avg", "mfu_avg", "peak_memory_bytes")   # measured: differ
    return [{k: v for k, v in m.items() if k not in timing} for m in lines]


def checkpoint_tensors(out: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor every rank wrote into a checkpoint, by file and name."""
    step_dir = out / "checkpoints" / f"step-{step:06d}"
    return {f"{f.name}:{k}": x for f in sorted(step_dir.glob("*.safetensors"))
            for k, x in load_file(f).items()}


def assert_same_run(a: Path, b: Path, step: int) -> None:
    assert metrics(a) == metrics(b)                             # losses, grad norms, lr: bitwise
    ta, tb = checkpoint_tensors(a, step), checkpoint_tensors(b, step)
    assert ta.keys() == tb.keys() and any("opt" in k for k in ta)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert (a / "comm_report.txt").read_text() == (b / "comm_report.txt").read_text()


def test_batched_train_equals_threaded_on_dp_shard_x_tp_with_eval(tmp_path):
    runs = {}
    for mode in ("threaded", "batched"):
        cfg = config(tmp_path / mode, mode, dp_shard_size=2, tp_size=2, sequence_parallel=True,
                     gradient_accumulation_steps=2, val_set_size=0.05)
        buf = io.StringIO()
        runs[mode] = train(cfg, stream=buf)
        assert f"4 simulated devices on the CPU ({mode}" in buf.getvalue()
        assert "step 3/3" in buf.getvalue()                 # the progress line: the lead prints
    assert runs["batched"].losses == runs["threaded"].losses and len(runs["batched"].losses) == 3
    assert "eval_loss" in metrics(tmp_path / "batched")[-1]
    assert_same_run(tmp_path / "threaded", tmp_path / "batched", 3)


def test_batched_save_and_resume_with_ring_cp_equals_threaded_uninterrupted(tmp_path):
    mesh = {"dp_shard_size": 2, "cp_size": 2}                # cp: ring attention
    whole = train(config(tmp_path / "threaded", "threaded", max_steps=4, **mesh), stream=io.StringIO())
    cfg = config(tmp_path / "batched", "batched", max_steps=4, checkpoint={"save_every": 2}, **mesh)
    first = train(cfg, stop_after=2, stream=io.StringIO())
    assert first.stopped and first.final_step == 2
    assert (tmp_path / "batched" / "checkpoints" / "step-000002" / "index.json").is_file()
    second = train(cfg, resume=True, stream=io.StringIO())
    assert second.start_step == 2 and second.final_step == 4
    assert first.losses + second.losses == whole.losses
    got = metrics(tmp_path / "batched")
    assert got[2].pop("resumed_from") == 2
    assert got == metrics(tmp_path / "threaded")
    ta, tb = checkpoint_tensors(tmp_path / "threaded", 4), checkpoint_tensors(tmp_path / "batched", 4)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_cli_sim_mode_flag_threaded_default_and_auto(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**BASE, "dp_shard_size": 2, "max_steps": 2}))
    assert cli.main(["train", str(path), "--output", str(tmp_path / "default")]) == 0
    assert "2 simulated devices on the CPU (threaded" in capsys.readouterr().out   # the default
    assert cli.main(["train", str(path), "--sim-mode", "auto", "--output", str(tmp_path / "auto")]) == 0
    assert "2 simulated devices on the CPU (batched" in capsys.readouterr().out    # auto: eager -> batched
    assert metrics(tmp_path / "auto") == metrics(tmp_path / "default")
    assert resolve_world(TrainConfig.from_yaml(path)).sim_mode == "threaded"
    assert resolve_world(TrainConfig.from_yaml(path, ["simulation=auto"])).sim_mode == "batched"
    assert resolve_world(TrainConfig.from_yaml(path, ["simulation=auto", "compile=true"])).sim_mode == "threaded"
    assert resolve_world(TrainConfig.from_yaml(path, ["simulation=auto", "dp_shard_size=1"])).sim_mode == "threaded"
    assert resolve_world(TrainConfig.from_yaml(path, ["simulation=batched"]), 2).sim_mode == "batched"
    assert resolve_world(TrainConfig.from_yaml(path, ["simulation=batched"]), 1).sim_mode == "threaded"


def test_batched_with_compile_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**BASE, "dp_shard_size": 2, "compile": True}))
    assert cli.main(["train", str(path), "--sim-mode", "batched", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "simulation: batched cannot run this config: compile: True" in err
    assert "--sim-mode threaded" in err
    assert not (tmp_path / "o").exists()                      # refused before any work
    with pytest.raises(ConfigError, match="simulation"):
        TrainConfig.from_dict({"simulation": "batch"})        # a typo: the choices are named


def test_host_view_in_a_batched_run(tmp_path):
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    rules = fpp.Rules(batch="dp_shard")
    tokens = torch.arange(4000) % 251

    def build(shard):
        return DataLoader(tokens, global_batch_size=4, seq_len=8, seed=0, **shard)

    def device():
        loader = device_loader(build, mesh, rules)
        batch = next(loader)
        saved = save_on_devices(lambda b: (fpp.current_rank(), b["tokens"].clone()), batch)
        return {"lead": is_lead(), "stacked": isinstance(loader, StackedLoader), "batch": batch["tokens"],
                "rank0": lead_value(fpp.current_rank), "saved": saved, "state": loader.state_dict()}

    batched = fpp.launch(device, mesh, simulate="batched")
    threaded = fpp.launch(device, mesh)
    assert [r["lead"] for r in batched] == [True] * 4 and [r["lead"] for r in threaded] == [True, False, False, False]
    assert batched[0]["stacked"] and not threaded[0]["stacked"]
    for b, t in zip(batched, threaded):
        assert torch.equal(b["batch"], t["batch"]) and b["state"] == t["state"]
    assert not torch.equal(batched[0]["batch"], batched[2]["batch"])       # dp_shard 0 and 1 differ
    assert batched[3]["rank0"] == 0 and batched[0]["saved"][0] == 0        # rank 0's value
    assert torch.equal(batched[0]["saved"][1], threaded[0]["batch"])


def test_cli_sim_benchmark_smoke(capsys):
    """benchmarks/cli_sim.py: the loop's step time, one device / threaded / batched, with ratios
    consistent with its own timings and the batched losses bitwise the threaded ones."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import cli_sim
    out = cli_sim.main(["--devices", "2", "--steps", "1", "--warmup", "1", "--repeats", "1",
                        "--batch", "4", "--seq", "16"])
    assert capsys.readouterr().out.strip().startswith("{")
    med = out["median"]
    assert out["ratio_cpu"]["batched"] == pytest.approx(med["batched"]["cpu_s"] / med["one"]["cpu_s"])
    assert all(med[k]["wall_s"] > 0 and med[k]["cpu_s"] > 0 for k in ("one", "threaded", "batched"))
    assert out["same_losses"] is True


def test_batched_rank_compared_to_an_int_is_refused():
    """``current_rank() == 0`` in a batched run was silently False (the lead's work skipped on
    every device): refused like the rank's other integer uses."""
    mesh = fpp.Mesh(dp_shard=2)
    with pytest.raises(RuntimeError, match="asked for the running device's rank as one integer"):
        fpp.launch(lambda: fpp.current_rank() == 0, mesh, simulate="batched")
    assert fpp.launch(lambda: fpp.current_rank() == 0, mesh) == [True, False]
