"""The training loop's step time (``functional-pp train``'s loop: data loader, step, metrics read
and logged every step) on one device and on N simulated devices, threaded and batched, in one
JSON line; the runs interleaved (one device, threaded, batched, again...) on a noisy machine.

    python benchmarks/cli_sim.py                          # tiny Llama, global batch 16 x 64, 16 devices
    python benchmarks/cli_sim.py --devices 8 --steps 5 --repeats 3

The config is examples/configs/4d.yaml's model and batch (16 devices: dp_replicate 2 x dp_shard 2
x cp 2 x tp 2 with sequence parallelism; 8: dp_shard 2 x cp 2 x tp 2; 4: dp_shard 2 x tp 2),
every run with one micro-batch per step (micro_batch_size = 16 / data-parallel size). A step's
time is read off the loop itself: the wall and process CPU clocks at each step's log call, after
``--warmup`` steps, divided by the steps in between; medians over ``--repeats``. No checkpoints,
no plot. ``same_losses``: whether the batched runs logged bitwise the threaded runs' losses.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

from functional_pp.app import loop, metrics
from functional_pp.config import TrainConfig

MESHES = {1: {}, 2: {"dp_shard_size": 2}, 4: {"dp_shard_size": 2, "tp_size": 2},
          8: {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2},
          16: {"dp_replicate_size": 2, "dp_shard_size": 2, "cp_size": 2, "tp_size": 2}}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=16, choices=sorted(set(MESHES) - {1}))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the timing starts")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each kind, interleaved")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    return ap.parse_args(argv)


def config(n_devices: int, simulation: str, args, out: Path) -> TrainConfig:
    mesh = MESHES[n_devices]
    dp = mesh.get("dp_replicate_size", 1) * mesh.get("dp_shard_size", 1)
    return TrainConfig.from_dict({
        **mesh, "sequence_parallel": n_devices > 1 and "tp_size" in mesh, "simulation": simulation,
        "global_batch_size": args.batch, "micro_batch_size": args.batch // dp, "sequence_len": args.seq,
        "learning_rate": 3e-3, "warmup_steps": 1, "max_steps": args.warmup + args.steps, "weight_decay": 0.1,
        "model": "tiny", "data": {"max_bytes": 300_000},
        "logging": {"log_every": 1, "plot": False, "output_dir": str(out)},
        "checkpoint": {"save_every": 0, "save_final": False}}, name="cli_sim")


def run(n_devices: int, simulation: str, args) -> dict:
    """One training run; seconds per step (wall, process CPU) after the warm-up, and its losses."""
    clocks: list[tuple[int, float, float]] = []
    make = metrics.make_loggers

    def timed_loggers(*a, **kw):
        loggers = make(*a, **kw)
        log = loggers.log

        def timed_log(step, m):
            if "loss" in m:
                clocks.append((step, time.perf_counter(), time.process_time()))
            return log(step, m)
        loggers.log = timed_log
        return loggers

    with tempfile.TemporaryDirectory() as tmp:
        metrics.make_loggers = timed_loggers
        try:
            result = loop.train(config(n_devices, simulation, args, Path(tmp) / "run"), stream=io.StringIO())
        finally:
            metrics.make_loggers = make
    (s0, w0, c0), (s1, w1, c1) = next(c for c in clocks if c[0] == args.warmup), clocks[-1]
    return {"wall_s": (w1 - w0) / (s1 - s0), "cpu_s": (c1 - c0) / (s1 - s0), "losses": result.losses}


def main(argv=None) -> dict:
    args = parse_args(argv)
    kinds = {"one": (1, "threaded"), "threaded": (args.devices, "threaded"), "batched": (args.devices, "batched")}
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for kind, (n, simulation) in kinds.items():
            runs[kind].append(run(n, simulation, args))
    med = {k: {c: statistics.median(r[c] for r in rs) for c in ("wall_s", "cpu_s")} for k, rs in runs.items()}
    out = {"model": "llama tiny", "global_batch": [args.batch, args.seq], "devices": args.devices,
           "steps": args.steps, "repeats": args.repeats,
           "per_run": {k: [{c: r[c] for c in ("wall_s", "cpu_s")} for r in rs] for k, rs in runs.items()},
           "median": med,
           "ratio_wall": {k: med[k]["wall_s"] / med["one"]["wall_s"] for k in ("threaded", "batched")},
           "ratio_cpu": {k: med[k]["cpu_s"] / med["one"]["cpu_s"] for k in ("threaded", "batched")},
           "same_losses": all(b["losses"] == t["losses"] for b, t in zip(runs["batched"], runs["threaded"]))}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
