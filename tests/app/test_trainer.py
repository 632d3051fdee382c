"""The training loop behind the CLI: bit-exact resume, SIGTERM checkpoints, the config's
parsing and checks, the progress line, and (slow) that the tiny model really learns."""
import io
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.app.progress import Progress
from functional_pp.app.world import World, resolve_world
from functional_pp.config import ConfigError, TrainConfig

BASE = {"dp_shard_size": 2, "tp_size": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
        "sequence_len": 32, "learning_rate": 3e-3, "lr_scheduler": "cosine", "warmup_steps": 2,
        "max_steps": 6, "weight_decay": 0.1, "model": "tiny", "data": {"max_bytes": 300_000},
        "logging": {"log_every": 1}}


def config(out: Path, **overrides) -> TrainConfig:
    d = {**BASE, **overrides}
    d["logging"] = {**d["logging"], "output_dir": str(out)}
    return TrainConfig.from_dict(d, name="t")


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out / "metrics.jsonl")]


def assert_same_checkpoint(a: Path, b: Path, step: int) -> None:
    keys = ["params", "opt", "step", "skipped"]           # rng is per rank: needs the same world
    ra, rb = ck.load_checkpoint(a, step=step, keys=keys), ck.load_checkpoint(b, step=step, keys=keys)
    assert ra.metadata == rb.metadata and ra.metadata["loader"]["step"] == step
    leaves_a = dict(_flat(ra.tree))
    leaves_b = dict(_flat(rb.tree))
    assert leaves_a.keys() == leaves_b.keys()
    assert any(k.startswith("opt.") for k in leaves_a) and "step." in leaves_a
    for k, x in leaves_a.items():
        assert torch.equal(x, leaves_b[k]), k


def _flat(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}.")


# --------------------------------------------------------------------------- resume
def test_resume_is_bit_exact_on_the_same_mesh(tmp_path):
    """6 steps straight == 3 steps, stop (as on SIGTERM), resume 3 more: on 4 devices with a
    cosine schedule, gradient accumulation and weight decay."""
    full, split = tmp_path / "full", tmp_path / "split"
    r = train(config(full), stream=io.StringIO())
    assert r.final_step == 6 and not r.stopped
    first = train(config(split), stop_after=3, stream=io.StringIO())
    assert first.stopped and first.final_step == 3 and len(losses(split)) == 3
    assert first.checkpoint == split / "checkpoints" / "step-000003"
    second = train(config(split), resume=True, stream=io.StringIO())
    assert second.start_step == 3 and second.final_step == 6 and len(second.losses) == 3
    assert losses(split) == losses(full)                       # bitwise, all six steps
    assert [m["step"] for m in read_metrics(split / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert_same_checkpoint(full / "checkpoints", split / "checkpoints", 6)
    assert losses(full)[-1] < losses(full)[0]


def test_cli_max_steps_then_resume_extends_training(tmp_path, capsys):
    """``--max-steps 3`` then ``--resume`` (to the config's 6); metrics lines past the
    checkpoint from an interrupted run are dropped and rewritten."""
    import yaml
    d = {**BASE, "dp_shard_size": 1, "lr_scheduler": "constant"}   # schedule independent of max_steps
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(d))
    full, split = tmp_path / "full", tmp_path / "split"
    assert cli.main(["train", str(cfg), "--output", str(full)]) == 0
    assert cli.main(["train", str(cfg), "--output", str(split), "--max-steps", "3"]) == 0
    with open(split / "metrics.jsonl", "a") as f:                # a step that the crash lost
        f.write(json.dumps({"step": 4, "loss": 123.0}) + "\n")
    capsys.readouterr()
    assert cli.main(["train", str(cfg), "--output", str(split), "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert losses(split) == losses(full) and len(losses(full)) == 6
    assert ck.CheckpointManager(split / "checkpoints").latest() == 6
    # resuming a finished run does nothing
    assert cli.main(["train", str(cfg), "--output", str(split), "--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().out and len(losses(split)) == 6


def test_sigterm_saves_at_the_next_step_boundary_and_ends_interrupted(tmp_path):
    """SIGTERM stops at a step boundary with a checkpoint and ends with Interrupted, exit status
    143 (it was 0: a ``train && export`` script took the stopped run for a finished one)."""
    from functional_pp.app.signals import Interrupted
    out = tmp_path / "run"
    cfg = config(out, max_steps=10_000, lr_scheduler="constant", warmup_steps=0)
    metrics = out / "metrics.jsonl"

    def send_sigterm_after_two_steps():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    def fallback(signum, frame):                                 # if train() installed no handler
        raise AssertionError("SIGTERM reached the default handler")

    before = signal.signal(signal.SIGTERM, fallback)
    try:
        threading.Thread(target=send_sigterm_after_two_steps, daemon=True).start()
        buf = io.StringIO()
        with pytest.raises(Interrupted, match=r"received SIGTERM: stopped at step \d+/10000 with checkpoint "
                                              r".*continue with --resume") as info:
            train(cfg, stream=buf, stop_after=500)              # stop_after: a safety net only
        assert signal.getsignal(signal.SIGTERM) is fallback      # handler restored
    finally:
        signal.signal(signal.SIGTERM, before)
    assert info.value.status == 143
    final_step = ck.CheckpointManager(out / "checkpoints").latest()
    assert 2 <= final_step < 100 and f"stopped at step {final_step}/" in str(info.value)
    assert "received SIGTERM" in buf.getvalue()
    assert len(losses(out)) == final_step
    restored = ck.load_checkpoint(out / "checkpoints", keys=["step"])
    assert restored.step == final_step and int(restored.tree["step"]) == final_step
    assert restored.metadata["loader"]["step"] == final_step
    assert restored.config["max_steps"] == 10_000
    again = train(config(out, max_steps=final_step + 1, lr_scheduler="constant", warmup_steps=0),
                  resume=True, stream=io.StringIO())
    assert again.start_step == final_step and again.final_step == final_step + 1


def test_devices_agree_on_the_step_to_stop_at(tmp_path, monkeypatch):
    """A stop request seen by device 0 only (SIGTERM reaching torchrun ranks at different
    times) stops every device at the same step boundary, with one checkpoint."""
    import functional_pp as fpp
    from functional_pp.app import loop as trainer

    class RankZeroFromItsThirdLook:
        def __init__(self):
            self.looks = 0

        def is_set(self):
            if fpp.current_rank() != 0:
                return False
            self.looks += 1
            return self.looks >= 3

    class Stop(trainer._StopRequest):
        def __init__(self):
            super().__init__()
            self.event = RankZeroFromItsThirdLook()

    monkeypatch.setattr(trainer, "_StopRequest", Stop)
    out = tmp_path / "run"
    r = train(config(out, dp_shard_size=2, tp_size=1, max_steps=10), stream=io.StringIO())
    assert r.stopped and r.final_step == 2 and len(losses(out)) == 2
    assert ck.CheckpointManager(out / "checkpoints").steps() == [2]


# --------------------------------------------------------------------------- config
def test_config_parses_accelerate_and_axolotl_names():
    cfg = TrainConfig.from_dict({"dp_replicate_size": 2, "dp_shard_size": 2, "cp_size": 2, "tp_size": 2,
                                 "sequence_parallel": True, "bf16": True, "compile": "aot_eager",
                                 "optimizer": "sgd", "momentum": 0.9, "lr_scheduler": "linear",
                                 "model": {"preset": "tiny", "layers": 4},
                                 "rules": {"vocab": None, "mlp": ["tp"]}})
    assert cfg.precision == "bf16" and cfg.compile == "aot_eager"
    assert cfg.model.build().layers == 4
    mesh = cfg.mesh(16)
    assert dict(mesh.shape) == {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}
    rules = cfg.build_rules(mesh)
    assert rules["vocab"] == () and rules["mlp"] == ("tp",) and rules["res_seq"] == ("cp", "tp")
    cfg.validate(16)
    assert TrainConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()      # round trip
    assert TrainConfig.from_dict({"model": "8b"}).model.build().hidden == 4096
    assert TrainConfig.from_dict({"dp_shard_size": -1, "tp_size": 2}).mesh(8).shape["dp_shard"] == 4


@pytest.mark.parametrize("d, message", [
    ({"learning_rat": 1e-3}, "unknown key 'learning_rat'; did you mean 'learning_rate'?"),
    ({"data": {"pth": "x"}}, "unknown key 'data.pth'; did you mean 'path'?"),
    ({"logging": {"outputdir": "x"}}, "unknown key 'logging.outputdir'; did you mean 'output_dir'?"),
    ({"model": {"preset": "tiny", "num_layers": 2}}, "unknown key 'model.num_layers'; did you mean 'layers'?"),
    ({"model": "7b"}, "model.preset '7b' is not a preset"),
    ({"tp_size": "2"}, "tp_size must be an integer, got '2'"),
    ({"sequence_parallel": 1}, "sequence_parallel must be true/false"),
    ({"lr_scheduler": "cosin"}, "did you mean 'cosine'?"),
    ({"optimizer": "adam"}, "did you mean 'adamw'?"),
    ({"optimizer": "sgd", "adam_beta2": 0.99}, "adam_beta2 does not apply to optimizer 'sgd'"),
    ({"precision": "fp16", "bf16": True}, "bf16: true contradicts precision: fp16"),
    ({"compile": "inductr"}, "did you mean 'inductor'?"),
    ({"micro_batch_size": 0}, "micro_batch_size must be >= 1"),
    ({"warmup_steps": 50, "max_steps": 10}, "warmup_steps=50 exceeds max_steps=10"),
    ({"data": {"kind": "jsonl"}}, "data.kind 'jsonl' needs data.path"),
])
def test_config_errors_while_parsing(d, message):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(d)
    assert message in str(info.value)


@pytest.mark.parametrize("d, world, message", [
    ({"tp_size": 2, "cp_size": 2}, 8, "the mesh needs 4 devices (dp_replicate_size=1 x dp_shard_size=1 x "
                                      "cp_size=2 x tp_size=2 = 4) but the world size gives 8"),
    ({"dp_shard_size": -1, "tp_size": 3}, 8, "dp_shard_size: -1 cannot fill a world of 8 devices"),
    ({"cp_size": 2, "sequence_len": 30}, 2, "sequence_len=30 is not divisible by 2 x cp_size = 4"),
    ({"dp_replicate_size": 2, "micro_batch_size": 3, "global_batch_size": 8}, 2,
     "global_batch_size=8 is not divisible by micro_batch_size x dp = 3 x 2 = 6"),
    ({"tp_size": 2, "sequence_parallel": True, "sequence_len": 33}, 2, "'res_seq' has size 33"),
    ({"tp_size": 8}, 8, "layers.0.self_attn.k_proj: dim 'kv_heads' has size 2"),
    ({"rules": {"hiden": "dp_shard"}}, 1, "unknown dim name 'hiden'; did you mean 'hidden'?"),
    ({"rules": {"hidden": "dp_shrd"}}, 1, "Did you mean 'dp_shard'?"),
    ({"rules": {"seq": ["cp", "tp"]}, "cp_size": 2, "tp_size": 2}, 4, "split over one mesh axis"),
    ({"data": {"path": "/no/such/corpus.txt"}}, 1, "data.path '/no/such/corpus.txt' does not exist"),
    ({"data": {"tokenizer": "/no/tokenizer.json"}}, 1, "data.tokenizer '/no/tokenizer.json' does not exist"),
])
def test_config_errors_against_the_world(d, world, message):
    cfg = TrainConfig.from_dict(d)
    with pytest.raises(ConfigError) as info:
        cfg.validate(world)
    assert message in str(info.value)


def test_global_batch_size_derives_gradient_accumulation():
    cfg = TrainConfig.from_dict({"dp_shard_size": 2, "micro_batch_size": 2, "global_batch_size": 16})
    mesh = cfg.mesh(2)
    rules = cfg.build_rules(mesh)
    cfg.validate(2)
    assert cfg.grad_accum(mesh, rules) == 4 and cfg.global_batch(mesh, rules) == 16


def test_default_world_is_the_mesh_on_simulated_devices(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    cfg = TrainConfig.from_dict({"dp_shard_size": 2, "tp_size": 2})
    if not torch.cuda.is_available():
        assert resolve_world(cfg) == World(4, True, "simulated devices")
    assert resolve_world(cfg, 4) == World(4, True, "--simulate 4")
    with pytest.raises(ConfigError, match="--simulate needs a device count"):
        resolve_world(cfg, 0)


def test_data_problems_found_before_training(tmp_path):
    corpus = tmp_path / "small.txt"
    corpus.write_text("hello world " * 20)                     # 240 bytes
    cfg = config(tmp_path / "out", data={"path": str(corpus)})
    with pytest.raises(ConfigError, match="fewer than global_batch_size=8"):
        train(cfg, stream=io.StringIO())
    assert not (tmp_path / "out").exists()
    cfg = config(tmp_path / "out", data={"path": str(corpus)}, model={"preset": "tiny", "vocab": 128})
    with pytest.raises(ConfigError, match="vocabulary 256 but the model only 128"):
        train(cfg, stream=io.StringIO())


# --------------------------------------------------------------------------- progress
def test_progress_one_line_per_log_every_off_a_terminal():
    buf = io.StringIO()
    p = Progress(total=20, log_every=5, stream=buf, tty=False)
    for s in range(1, 21):
        p.update(s, {"loss": 5.0 - s / 10, "tokens_per_s_avg": 1000.0})
    lines = buf.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/20", "5/20", "10/20", "15/20", "20/20"]
    assert "loss 3.0000" in lines[-1] and "1,000 tok/s" in lines[-1] and "ETA 00:00" in lines[-1]
    assert "ETA ?" in lines[0]


def test_progress_rewrites_one_line_on_a_terminal():
    buf = io.StringIO()
    p = Progress(total=3, log_every=100, stream=buf, tty=True)
    p.update(1, {"loss": 2.0, "tokens_per_s_avg": 10.0})
    p.message("saved checkpoint x")
    p.update(2, {"loss": 1.5, "tokens_per_s_avg": 10.0})
    p.update(3, {"loss": 1.0, "tokens_per_s_avg": 10.0})
    text = buf.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and "\nsaved checkpoint x\n" in text
    eta = Progress(total=10, stream=io.StringIO(), tty=False)
    eta.update(1, {"loss": 1.0})
    assert "ETA 00:08" in eta.line(2, {"loss": 1.0}, now=eta._t0 + 1.0)   # 1 s/step, 8 to go


# --------------------------------------------------------------------------- learning
@pytest.mark.slow
def test_tiny_model_learns_the_standard_library(tmp_path):
    """300 steps of 8 x 64 bytes on one device: the loss falls well below ln(256) = 5.545."""
    cfg = TrainConfig.from_dict({
        "micro_batch_size": 8, "sequence_len": 64, "learning_rate": 3e-3, "lr_scheduler": "cosine",
        "warmup_steps": 20, "max_steps": 300, "weight_decay": 0.1, "model": "tiny",
        "logging": {"output_dir": str(tmp_path / "run"), "log_every": 50},
        "checkpoint": {"save_final": False}})
    r = train(cfg, stream=io.StringIO())
    assert r.final_step == 300
    first, last = r.losses[:5], r.losses[-20:]
    assert min(first) > 5.0                                     # starts near uniform: ln 256
    assert sum(last) / len(last) < 3.0, f"mean loss of the last 20 steps: {sum(last) / len(last):.3f}"
    assert all(math.isfinite(x) for x in r.losses)
    assert (tmp_path / "run" / "loss.png").is_file()


def test_resume_on_a_different_mesh_continues_the_single_device_run(tmp_path):
    """Stop after 3 steps on 4 devices (FSDP x TP), resume on 2 (CP) and on 1: the losses
    continue the uninterrupted single-device run within floating-point tolerance."""
    one = dict(dp_shard_size=1, tp_size=1, micro_batch_size=4)
    reference = train(config(tmp_path / "ref", **one), stream=io.StringIO())
    for name, resumed in (("cp", dict(dp_shard_size=1, tp_size=1, cp_size=2, micro_batch_size=4)),
                          ("one", one)):
        out = tmp_path / name
        train(config(out), stop_after=3, stream=io.StringIO())
        second = train(config(out, **resumed), resume=True, stream=io.StringIO())
        assert second.start_step == 3 and second.final_step == 6
        torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(tmp_path / "ref")),
                                   rtol=2e-5, atol=2e-5)
    assert reference.final_step == 6
