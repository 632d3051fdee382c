"""benchmarks/instr_count.py: the callgrind dumps of steps counted between client requests are
read back per side, with totals and the functions where one side executes more (a small C
program stands in for the two training steps, so the test takes about a second)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import instr_count  # noqa: E402

PROGRAM = r"""
#include <valgrind/callgrind.h>
volatile double sink;
__attribute__((noinline)) void shared_work(int n) { double s = 0; for (int i = 0; i < n; i++) s += i * 0.5; sink = s; }
__attribute__((noinline)) void guard_read(int n) { double s = 0; for (int i = 0; i < n; i++) s += i * 0.25; sink = s; }
__attribute__((noinline)) void uncounted(int n) { double s = 0; for (int i = 0; i < n; i++) s += i; sink = s; }
int main(void) {
  uncounted(1000000);                          /* like imports and compilation: not instrumented */
  for (int rep = 0; rep < 2; rep++) {
    CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION;
    shared_work(100000); guard_read(50000);    /* "ours": the shared work and a read of its own */
    CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(rep ? "functional-1" : "functional-0");
    CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION;
    shared_work(100000);                       /* "plain" */
    CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(rep ? "plain-1" : "plain-0");
    uncounted(100000);
  }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("gcc") is None
                    or not os.path.exists("/usr/include/valgrind/callgrind.h"), reason="needs valgrind and gcc")
def test_counted_steps_are_read_per_side_with_the_excess_named(tmp_path, capsys):
    src, exe = tmp_path / "steps.c", tmp_path / "steps"
    src.write_text(PROGRAM)
    subprocess.run(["gcc", "-O1", "-g", str(src), "-o", str(exe)], check=True)
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={tmp_path}/callgrind.out", str(exe)],
                   check=True, capture_output=True, timeout=120)
    files = sorted(f for f in os.listdir(tmp_path) if f.startswith("callgrind.out."))
    dumps = [instr_count.read_dump(str(tmp_path / f)) for f in files]
    steps = [d for d in dumps if d["trigger"].split("-")[0] in ("functional", "plain")]
    assert sorted(d["trigger"] for d in steps) == ["functional-0", "functional-1", "plain-0", "plain-1"]
    summary = instr_count.summarise(steps, top=5)
    (f0, f1), (p0, p1) = summary["totals"]["functional"], summary["totals"]["plain"]
    assert f0["Ir"] == f1["Ir"] and p0["Ir"] == p1["Ir"]          # the same step counts the same
    assert 1.3 < f0["Ir"] / p0["Ir"] < 1.7                      # half the shared work again
    top = summary["excess"][0]
    assert top["name"] == "guard_read" and top["plain"] == 0 and top["diff"] > 0.25 * p0["Ir"]
    assert all(r["name"] != "uncounted" for r in summary["excess"] + summary["deficit"])
    instr_count.annotate(str(tmp_path), top=5, json_path=None)
    out = capsys.readouterr().out
    assert "ratio functional/plain Ir" in out and "guard_read" in out
