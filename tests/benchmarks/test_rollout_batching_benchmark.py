"""benchmarks/rollout_batching.py on a tiny Llama: the one left-padded call's greedy completions
equal the per-length calls' (checked by the script), in 1 generate call against one per length."""
import os
import re
import subprocess
import sys
from pathlib import Path


def test_one_call_against_one_per_length_runs_and_counts_the_calls():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout_batching.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script), "--prompts", "5", "--generations", "2", "--new", "4",
                          "--hidden", "32", "--layers", "1", "--vocab", "64", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "greedy completions equal" in out.stdout
    calls = dict(re.findall(r"(per length|one call): +(\d+) generate calls", out.stdout))
    assert calls == {"per length": "5", "one call": "1"}, out.stdout
    assert re.search(r"ratio per length / one call: [\d.]+x", out.stdout)
