"""Replay compiled steps captured by ``benchmarks/instr_count.py`` natively, interleaved, and
print the process CPU and wall time per step: the functional step of each capture (say, before
and after a change) and plain torch's step of the first, alternating the order every round.

Only the compiled graphs run (their output code, with the inputs recorded from a real step):
no dynamo guards, autograd engine or Python around them, so two versions of our step compare
kernel for kernel in one process, on the same inputs (docs/compile.md "Measurements").

    python benchmarks/instr_count.py --out /tmp/before ...   # on the old code, then the new
    python benchmarks/replay_steps.py /tmp/before /tmp/after --rounds 8

Run it with the environment the captures were made in (instr_count.py's AVX2 settings:
``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
TORCHINDUCTOR_CPP_MARCH=x86-64-v3``), so that the kernels load from inductor's cache.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from instr_count import load_graph_modules  # noqa: E402

import functional_pp  # noqa: E402,F401  (registers the fpp:: custom ops the output code calls)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="+", help="instr_count.py --out directories (each holds steps.pt)")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sides = {}
    for i, d in enumerate(args.captures):
        path = os.path.join(d, "steps.pt")
        if not os.path.exists(path):
            ap.error(f"{path} not found: run benchmarks/instr_count.py --out {d} first")
        steps = torch.load(path, weights_only=False)
        sides[f"functional[{os.path.basename(d.rstrip('/'))}]"] = steps["functional"]
        if i == 0:
            sides["plain"] = steps["plain"]
    modules = load_graph_modules(sides.values())

    def run(calls):
        runs = [(modules[p], [x.clone() if isinstance(x, torch.Tensor) else x for x in a]) for p, a in calls]
        c0, t0 = time.process_time(), time.perf_counter()
        for mod, inputs in runs:
            mod.call(inputs)
        return time.process_time() - c0, time.perf_counter() - t0

    for calls in sides.values():
        run(calls)
    res = {s: [] for s in sides}
    order = list(sides)
    for i in range(args.rounds):
        for s in (order if i % 2 == 0 else order[::-1]):
            res[s].append(run(sides[s]))
    plain_cpu = [c for c, _ in res["plain"]]
    for s, r in res.items():
        cpu, wall = [c for c, _ in r], [w for _, w in r]
        print(f"{s:28s} CPU median {statistics.median(cpu) * 1e3:8.1f} ms  wall median "
              f"{statistics.median(wall) * 1e3:8.1f} ms  CPU/plain per round "
              + " ".join(f"{c / p:.3f}" for c, p in zip(cpu, plain_cpu)))


if __name__ == "__main__":
    main()
