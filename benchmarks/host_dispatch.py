"""Host seconds per launched op of an eager training step: the number behind
``Cluster.launch_seconds`` (docs/planning.md, "Time model": the host term).

    python benchmarks/host_dispatch.py                  # Llama-3.2-1B's structure, hidden 32
    python benchmarks/host_dispatch.py --steps 60 --json out.json

The step is ``benchmarks/gpu.py``'s functional eager side (``fpp.train_step``, bf16 with fp32
masters, AdamW, donated state, the loss read after every step) on a model with Llama-3.2-1B's
structure (16 layers, tied embeddings, GQA: the same parameter leaves and the same ops per step)
but tiny tensors, on one CPU thread: its kernels take almost no time, so the step's process CPU
time is the host's work of dispatching it (Python, the framework's op plans, ATen's dispatch)
plus the tiny kernels. Divided by the ops that launch a kernel (``plan.tracker.launches_kernel``,
counted under a dispatch mode over one step) it is the host's cost per launch. What it leaves
out on a GPU host: CUDA's own launch call (a few microseconds) and the difference between this
machine's CPU and the GPU host's. The dry-run's count of the same step
(``DeviceRun.launches``, extrapolated over the layers) is printed beside the measured one.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import functional_pp as fpp  # noqa: E402
from functional_pp import plan  # noqa: E402
from functional_pp.models import llama  # noqa: E402
from functional_pp.plan.tracker import launches_kernel  # noqa: E402


class CountLaunches(TorchDispatchMode):
    """Counts the ops of a region that launch a kernel."""

    def __init__(self):
        super().__init__()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_kernel(func, func.__name__):
            self.launches += 1
        return func(*args, **(kwargs or {}))


def config(hidden: int, layers: int) -> llama.Config:
    """Llama-3.2-1B's structure (its layers, tied embeddings, 4 query heads per k/v head) at ``hidden``."""
    return llama.Config.llama3_1b(hidden=hidden, layers=layers, heads=4, kv_heads=1, mlp=4 * hidden, vocab=256,
                                  rope_scaling=None)


def measure(hidden: int = 32, layers: int = 16, batch: int = 1, seq: int = 8, steps: int = 40,
            warmup: int = 5) -> dict:
    """Launches per step, the median process CPU seconds per step and their ratio."""
    torch.set_num_threads(1)
    cfg = config(hidden, layers)
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-4), precision="bf16",
                          donate_state=True)
    state = step.init(fpp.init(llama.init, cfg, seed=0))
    ids = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    data = {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    for _ in range(warmup):
        state, m = step(state, data)
        float(m["loss"])
    counter = CountLaunches()
    with counter:
        state, m = step(state, data)
    float(m["loss"])
    cpu = []
    for _ in range(steps):
        c0 = time.process_time()
        state, m = step(state, data)
        float(m["loss"])
        cpu.append(time.process_time() - c0)
    est = plan.estimate(functools.partial(llama.loss, cfg=cfg), llama.init(cfg, torch.bfloat16), fpp.Mesh(),
                        fpp.Rules(), {k: ((batch, seq), "batch seq") for k in ("tokens", "labels")},
                        precision="bf16", timeline=False)
    step_s = statistics.median(cpu)
    return {"model": {"hidden": hidden, "layers": layers, "batch": batch, "seq": seq}, "launches": counter.launches,
            "dry_run_launches": est.extrapolate(lambda r: sum(r.launches.values())), "cpu_s_per_step": step_s,
            "seconds_per_launch": step_s / counter.launches, "torch": torch.__version__,
            "load_average": os.getloadavg()[0]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = measure(args.hidden, args.layers, steps=args.steps)
    print(f"{out['launches']} launches per step (the dry-run counts {out['dry_run_launches']:.0f}), "
          f"{out['cpu_s_per_step'] * 1e3:.1f} CPU-ms per step: {out['seconds_per_launch'] * 1e6:.1f} us per launch "
          f"(load average {out['load_average']:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
