"""Runs do not overwrite each other (issue 46): a second ``functional-pp train`` on the output
directory of a live run is refused at once naming the holder, and writes nothing there; a lock
left by a dead process does not block; ``resume_from_checkpoint`` pointing at run A with run
B's output directory is refused naming both, unless ``--overwrite-output``. Bounded: every wait
has a timeout, the background run is stopped in ``finally``."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.app.run_lock import LOCK_FILE, RunLock

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "lr_scheduler": "constant",
        "data": {"max_bytes": 100_000}, "logging_steps": 1}


def _write(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump({**BASE, **keys}))
    return path


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def test_a_second_run_on_a_live_runs_output_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    cfg = _write(tmp_path / "c.yaml", max_steps=100_000, save_steps=0, output_dir=str(out))
    proc = subprocess.Popen([sys.executable, "-m", "functional_pp", "train", str(cfg), "--simulate", "1"],
                            cwd=tmp_path, env=_env(), text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first run logged no steps within 300 s"
            time.sleep(0.05)
        before = (out / "metrics.jsonl").read_text()
        status = cli.main(["train", str(_write(tmp_path / "d.yaml", max_steps=2, output_dir=str(out))),
                           "--simulate", "1"])
        err = capsys.readouterr().err
        assert status == 2, err
        assert f"output_dir {out} is in use by another run (pid {proc.pid} on" in err
        assert "--output DIR" in err
        # nothing of the second run reached the directory (the first run only appended)
        assert (out / "metrics.jsonl").read_text().startswith(before)
        assert all(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, timeout=60)
    (out / LOCK_FILE).write_text(json.dumps({"pid": int(dead.stdout), "host": "h", "started": "then"}))
    status = cli.main(["train", str(_write(tmp_path / "c.yaml", max_steps=1, output_dir=str(out))),
                       "--simulate", "1"])
    assert status == 0, capsys.readouterr().err
    lock = RunLock()                        # released when the run ended
    lock.acquire(out)
    lock.release()


def test_resume_from_another_run_into_a_used_output_dir_is_refused(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert cli.main(["train", str(_write(tmp_path / "c.yaml", max_steps=2, output_dir=str(d))),
                         "--simulate", "1"]) == 0
    capsys.readouterr()
    b_metrics = (b / "metrics.jsonl").read_text()
    b_ckpt = ck.CheckpointManager(b / "checkpoints").latest()
    cfg = _write(tmp_path / "r.yaml", max_steps=3, output_dir=str(b),
                 resume_from_checkpoint=str(a / "checkpoints" / "step-000002"))
    status = cli.main(["train", str(cfg), "--simulate", "1"])
    err = capsys.readouterr().err
    assert status == 2 and f"resuming from {a / 'checkpoints'} into output_dir {b}" in err, err
    assert "checkpoints up to step 2 and metrics.jsonl" in err and "--overwrite-output" in err
    assert (b / "metrics.jsonl").read_text() == b_metrics
    assert ck.CheckpointManager(b / "checkpoints").latest() == b_ckpt
    # into a new directory: the normal fork of a run
    fresh = _write(tmp_path / "f.yaml", max_steps=3, output_dir=str(tmp_path / "c"),
                   resume_from_checkpoint=str(a / "checkpoints" / "step-000002"))
    assert cli.main(["train", str(fresh), "--simulate", "1"]) == 0, capsys.readouterr().err
    assert [json.loads(x)["step"] for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()] == [3]
    # asked for explicitly: written into b
    assert cli.main(["train", str(cfg), "--simulate", "1", "--overwrite-output"]) == 0, capsys.readouterr().err
    assert ck.CheckpointManager(b / "checkpoints").latest() == 3
