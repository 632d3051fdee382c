"""scripts/gpu_lease.sh, the one prepared run for a lent GPU: it parses, refuses an unknown
mode naming the usage, and its run mode installs optree only from the carried wheels."""
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_lease.sh"


def test_the_script_parses_and_names_its_modes():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    r = subprocess.run(["bash", str(SCRIPT), "nonsense"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "prepare|run" in r.stderr


def test_the_run_installs_from_the_carried_wheels_only():
    text = SCRIPT.read_text()
    run = text[text.index("  run)"):]
    assert "--no-index --find-links .whl optree" in run      # the GPU machine has no network
    assert "benchmarks/gpu.py --json" in run
