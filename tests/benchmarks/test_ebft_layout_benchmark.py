"""benchmarks/ebft_layout.py ``--memory`` on a tiny Llama: the block-parallel row's forward +
backward with its prefix mask whole and by blocks of queries (ops/query_chunks.py) gives the
same loss, and the blocks' peak is the lower."""
import os
import re
import subprocess
import sys
from pathlib import Path


def test_the_memory_comparison_runs_and_the_blocks_peak_lower():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "ebft_layout.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script), "--seq", "128", "--hidden", "32", "--layers", "1",
                          "--vocab", "64", "--memory", "--repeats", "1"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    peaks = [float(x) for x in re.findall(r"row of 668 tokens: peak +([\d.]+) MiB", out.stdout)]
    assert len(peaks) == 2 and peaks[1] < peaks[0], out.stdout
