"""What simulating devices costs: one training step of the same tiny Llama and the same global
batch on 1, 8 and 16 simulated devices (eager), as ratios to one device, in one JSON line.

    python benchmarks/sim_overhead.py                 # tiny Llama, global batch 16 x 64, 10 steps
    python benchmarks/sim_overhead.py --steps 5 --devices 1,16
    python benchmarks/sim_overhead.py --devices 1,16 --batched   # threaded and batched side by side

Meshes: 8 = dp_shard 2 x cp 2 x tp 2, 16 = dp_replicate 2 x dp_shard 2 x cp 2 x tp 2, with
``llama.default_rules(sequence_parallel=True)`` (FSDP, TP+SP, ring attention). The step time
is measured on device 0 between two barriers (all devices have finished the warm-up steps
before, and the timed steps after); medians over ``--repeats`` runs of ``--steps`` steps.
Process CPU time per step is reported too (less sensitive to other jobs on a shared machine).

Where the time goes (docs/simulation.md): ``device_cpu_s`` is one device thread's CPU time per
step (median over the devices), ``collectives_cpu_s`` the part of it inside simulated
collectives (one more run of ``--steps`` steps with the collectives timed), and
``ratio_without_collectives`` is N x (device_cpu_s - collectives_cpu_s) / one device's CPU
time: the ratio if simulated collectives cost nothing and the devices' Python ran one at a
time, as CPython's global interpreter lock makes it run.

``--batched`` also measures every device count above 1 with ``launch(simulate="batched")`` (all
devices in one run, every op batched over a device dimension; docs/simulation.md): its ratios
are reported under ``batched`` next to the threaded ones, with ``same_params``: whether both
simulations ended with bitwise the same parameters on every device.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time

import torch

import functional_pp as fpp
from functional_pp.data import DataLoader
from functional_pp.devices import sim
from functional_pp.models import llama

MESHES = {1: dict(), 2: dict(dp_shard=2), 4: dict(dp_shard=2, tp=2), 8: dict(dp_shard=2, cp=2, tp=2),
          16: dict(dp_replicate=2, dp_shard=2, cp=2, tp=2)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="1,8,16", help="comma-separated device counts (1, 2, 4, 8, 16)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--compile", default="", help="compile the step on every side: 'inductor' or a backend "
                    "name (one compilation shared by the simulated devices); default eager")
    ap.add_argument("--batched", action="store_true",
                    help="also run the device counts above 1 as one batched simulation (simulate='batched')")
    args = ap.parse_args(argv)
    args.devices = [int(d) for d in args.devices.split(",")]
    for d in args.devices:
        if d not in MESHES:
            ap.error(f"--devices: {d} is not one of {sorted(MESHES)}")
    return args


def _barrier(mesh: fpp.Mesh) -> None:
    if mesh.size > 1:
        fpp.psum(torch.zeros(()), tuple(a for a, s in mesh.shape.items() if s > 1))


class _CollectiveClock(threading.local):
    """Per device thread: whether simulated collectives are timed now, and their CPU seconds."""
    on = False
    seconds = 0.0


_clock = _CollectiveClock()
_run_collective = sim.run_collective


def _timed_run_collective(*args):
    if not _clock.on:
        return _run_collective(*args)
    t0 = time.thread_time()
    try:
        return _run_collective(*args)
    finally:
        _clock.seconds += time.thread_time() - t0


def measure(n_devices: int, args, batched: bool = False) -> dict:
    """Seconds (wall and process CPU) per step on ``n_devices`` simulated devices (one thread
    each, or with ``batched`` all in one batched run)."""
    cfg = llama.Config.tiny()
    mesh = fpp.Mesh(**MESHES[n_devices])
    rules = llama.default_rules(sequence_parallel=True)
    opt = fpp.optim.adamw(1e-3, weight_decay=0.1, clip_norm=1.0)
    compile_mode = True if args.compile == "inductor" else (args.compile or False)
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), opt, mesh=mesh, rules=rules,
                          compile=compile_mode)
    corpus = torch.randint(0, cfg.vocab, (args.batch * args.seq * 64 + 1,), generator=torch.Generator().manual_seed(0))

    def device():
        # per_device: each device's own value (a batched run builds them all and stacks them)
        state = step.init(fpp.per_device(lambda: fpp.init(llama.init, cfg, mesh=mesh, rules=rules, seed=0)))
        dp = tuple(a for a in ("dp_replicate", "dp_shard") if mesh.shape[a] > 1) or ("dp_shard",)
        loaders = {}

        def my_batch():
            rank = fpp.current_rank()
            if rank not in loaders:
                loaders[rank] = iter(DataLoader(corpus.numpy(), global_batch_size=args.batch, seq_len=args.seq,
                                                seed=0, dp_rank=fpp.axis_index(dp), dp_size=fpp.axis_size(dp),
                                                cp_rank=fpp.axis_index("cp"), cp_size=fpp.axis_size("cp")))
            return next(loaders[rank])

        class _Loader:
            def __next__(self):
                return fpp.per_device(my_batch)
        loader = _Loader()
        for _ in range(args.warmup):
            state, metrics = step(state, next(loader))
        walls, cpus, mine = [], [], []
        for _ in range(args.repeats):
            _barrier(mesh)
            t0, c0, d0 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(args.steps):
                state, metrics = step(state, next(loader))
            mine.append((time.thread_time() - d0) / args.steps)
            _barrier(mesh)
            walls.append((time.perf_counter() - t0) / args.steps)
            cpus.append((time.process_time() - c0) / args.steps)
        _clock.on, _clock.seconds = True, 0.0          # one more run, its collectives timed
        for _ in range(args.steps):
            state, metrics = step(state, next(loader))
        _clock.on = False
        return (statistics.median(walls), statistics.median(cpus), float(metrics["loss"]),
                statistics.median(mine), _clock.seconds / args.steps, state["params"])

    sim.run_collective = _timed_run_collective
    try:
        results = fpp.launch(device, mesh, simulate="batched" if batched else True)
    finally:
        sim.run_collective = _run_collective
    wall, cpu, loss = results[0][:3]
    return {"wall_s": wall, "cpu_s": cpu, "last_loss": loss,
            "device_cpu_s": statistics.median(r[3] for r in results),
            "collectives_cpu_s": statistics.median(r[4] for r in results),
            "params": [r[5] for r in results]}


def _same_params(a: list, b: list) -> bool:
    """Whether two runs ended with bitwise the same parameters on every device."""
    import optree
    return all(torch.equal(x, y) for pa, pb in zip(a, b)
               for x, y in zip(optree.tree_leaves(pa), optree.tree_leaves(pb)))


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)               # simulated devices run one intra-op thread each
    try:
        results, batched = {}, {}
        for n in args.devices:
            results[n] = measure(n, args)
            if args.batched and n > 1:     # the same step, batched, right after the threaded one
                batched[n] = measure(n, args, batched=True)
    finally:
        torch.set_num_threads(threads)
    base = results[min(results)]
    same = {str(n): _same_params(results[n].pop("params"), r.pop("params")) for n, r in batched.items()}
    for r in results.values():
        r.pop("params", None)
    out = {"model": "llama tiny", "compile": args.compile or "eager", "global_batch": [args.batch, args.seq], "steps": args.steps,
           "devices": {str(n): r for n, r in results.items()},
           "ratio_wall": {str(n): r["wall_s"] / base["wall_s"] for n, r in results.items()},
           "ratio_cpu": {str(n): r["cpu_s"] / base["cpu_s"] for n, r in results.items()},
           "ratio_without_collectives": {str(n): n * (r["device_cpu_s"] - r["collectives_cpu_s"]) / base["cpu_s"]
                                         for n, r in results.items()}}
    if args.batched:
        out["batched"] = {"devices": {str(n): {k: r[k] for k in ("wall_s", "cpu_s", "last_loss")}
                                      for n, r in batched.items()},
                          "ratio_wall": {str(n): r["wall_s"] / base["wall_s"] for n, r in batched.items()},
                          "ratio_cpu": {str(n): r["cpu_s"] / base["cpu_s"] for n, r in batched.items()},
                          "same_params": same}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
