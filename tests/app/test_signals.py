"""Ctrl-C does not lose the run (issue 46): a real ``functional-pp train`` process receives
SIGINT, two SIGINTs or SIGHUP once it has logged steps; it stops at a step boundary, saves a
checkpoint holding the last logged step, says so and exits 130 (SIGHUP: 129), where it used to
abort (exit -6) with no checkpoint; SIGTERM the same with 143 (it exited 0, as if finished). Bounded: every wait has a timeout, the process is killed
if it outlives it."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from functional_pp import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out"
    cfg = {"model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "max_steps": 100_000,
           "lr_scheduler": "constant", "data": {"max_bytes": 100_000}, "logging_steps": 1,
           "save_steps": 0, "output_dir": str(out)}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "functional_pp", "train", str(tmp_path / "c.yaml"),
                             "--simulate", "2"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, out


def _wait_for_steps(proc: subprocess.Popen, metrics: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ended early ({proc.returncode}): {proc.communicate()[1][-2000:]}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} steps logged within {timeout} s")


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"still running {timeout} s after the signal")
    return proc.returncode, out, err


@pytest.mark.parametrize("signals, status", [
    ((signal.SIGINT,), 130),
    ((signal.SIGINT, signal.SIGINT), 130),
    ((signal.SIGHUP,), 129),
    ((signal.SIGTERM,), 143),
], ids=["SIGINT", "two SIGINTs", "SIGHUP", "SIGTERM"])
def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint(tmp_path, signals, status):
    proc, out = _start(tmp_path)
    _wait_for_steps(proc, out / "metrics.jsonl", 2)
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.01)              # a double tap: both arrive while the run stops
    code, stdout, stderr = _finish(proc)
    name = signal.Signals(signals[0]).name
    assert code == status, (code, stderr[-3000:])
    assert "terminate called" not in stderr and "Traceback" not in stderr
    assert f"received {name}: stopping at the next step boundary" in stderr
    assert f"Interrupted: received {name}: stopped at step" in stderr and "continue with --resume" in stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    saved = ck.CheckpointManager(out / "checkpoints").latest()
    assert saved == steps[-1] >= 2
    restored = ck.load_checkpoint(out / "checkpoints", keys=["step"])
    assert int(restored.tree["step"]) == saved and restored.metadata["loader"]["step"] == saved


def test_a_second_sigint_while_the_checkpoint_is_written_does_not_lose_it(tmp_path, monkeypatch):
    """In process: the first SIGINT after two logged steps, the second from inside the
    checkpoint save; the save finishes, train() raises Interrupted (status 130) naming it, and
    SIGINT's old handler is back."""
    import threading

    from functional_pp.app.loop import train
    from functional_pp.app.signals import Interrupted
    from functional_pp.config import TrainConfig
    out = tmp_path / "out"
    cfg = TrainConfig.from_dict({"model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "max_steps": 10_000,
                                 "lr_scheduler": "constant", "data": {"max_bytes": 100_000}, "logging_steps": 1,
                                 "save_steps": 0, "output_dir": str(out)})
    real_save, sent = ck.CheckpointManager.save, threading.Event()

    def save_with_a_second_sigint(self, *a, **k):
        if not sent.is_set():                        # (every device saves its part)
            sent.set()
            os.kill(os.getpid(), signal.SIGINT)      # handled on the main thread while this saves
            time.sleep(0.1)
        return real_save(self, *a, **k)
    monkeypatch.setattr(ck.CheckpointManager, "save", save_with_a_second_sigint)

    def first_sigint():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)
    before = signal.getsignal(signal.SIGINT)
    threading.Thread(target=first_sigint, daemon=True).start()
    with pytest.raises(Interrupted) as e:
        train(cfg, simulate=2, stop_after=500)                    # stop_after: a safety net only
    assert signal.getsignal(signal.SIGINT) is before and sent.is_set()
    assert e.value.status == 130 and "received SIGINT: stopped at step" in str(e.value)
    saved = ck.CheckpointManager(out / "checkpoints").latest()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert saved == steps[-1] < 500 and str(out / "checkpoints") in str(e.value)
    assert int(ck.load_checkpoint(out / "checkpoints", keys=["step"]).tree["step"]) == saved
