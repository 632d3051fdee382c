"""Eager per-step overhead on a tiny model: the functional Llama (``fpp.train_step``, eager, one
device) against the same model as a plain ``nn.Module`` with ``torch.optim.AdamW``.

The model is so small (hidden 64, 2 layers) that kernels take almost no time and the step time
is the Python work around them: what this measures is the framework's dispatch overhead (named
values, layout reconciliation, optimizer transforms), not arithmetic.

    python benchmarks/eager_overhead.py                    # ratio + Python call counts
    python benchmarks/eager_overhead.py --steps 200 --threads 1 --json out.json
    python benchmarks/eager_overhead.py --precision bf16     # fp32 masters / autocast

Both sides start from the same weights (the plain module is loaded from the functional
parameters; the first-step losses are printed and checked to agree). Steps are interleaved
(functional, plain, functional, ...) so machine noise hits both; the median wall time and the
median process CPU time per step are reported. Python call counts per step come from
``cProfile`` over a few extra steps of each side (primitive + recursive calls, as ``pstats``
counts them); the ten functions of ours called most often per step are listed.

The functional step reads its metrics only when asked: the timed loop reads the loss of both
sides every step (``float`` on the functional side, ``loss.item()`` on the plain side), as a
training loop that logs every step would.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from single_device import FunctionalRunner, PlainRunner, make_batch, make_config  # noqa: E402

import functional_pp as fpp  # noqa: E402
from functional_pp.models import llama  # noqa: E402

MODEL = dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128)


def _timed(step, batch) -> tuple[float, float, float]:
    """(wall s, process CPU s, loss) of one step."""
    w0, c0 = time.perf_counter(), time.process_time()
    loss = float(step(batch))
    return time.perf_counter() - w0, time.process_time() - c0, loss


def call_counts(runner, batch, steps: int) -> tuple[float, list[tuple[str, float]]]:
    """Python calls per step of ``runner`` and its most-called functions of functional_pp."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        float(runner.step(batch))
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(nc for (_, nc, _, _, _) in stats.values())
    ours = [(f"{os.path.relpath(f, os.path.dirname(fpp.__file__))}:{line}({name})", nc / steps)
            for (f, line, name), (_, nc, _, _, _) in stats.items() if "functional_pp" in f]
    ours.sort(key=lambda t: -t[1])
    return total / steps, ours[:10]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per side (default 60)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=5, help="steps per side under cProfile")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: ours with fp32 masters, plain torch under autocast (default fp32)")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = make_config("tiny", args.seq)
    params = fpp.init(llama.init, cfg, seed=0)
    batch = make_batch(cfg, args.batch, args.seq, "cpu")
    fn = FunctionalRunner(cfg, params, False, args.precision, "cpu")
    plain = PlainRunner(cfg, params, False, args.precision, "cpu", args.seq)
    print(f"eager overhead ({args.precision}): Llama hidden {cfg.hidden}, {cfg.layers} layers, "
          f"{fpp.count_params(llama.init(cfg))} params, "
          f"batch {args.batch} x seq {args.seq}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")

    first = {"functional": float(fn.step(batch)), "plain": float(plain.step(batch))}
    print(f"first-step loss: functional {first['functional']:.7f}  plain {first['plain']:.7f}")
    rel = abs(first["functional"] - first["plain"]) / abs(first["plain"])
    if rel > 1e-4:
        raise SystemExit(f"first-step losses differ by {rel:.2e} (relative): not the same model")
    for _ in range(args.warmup):
        fn.step(batch), plain.step(batch)
    times = {"functional": [], "plain": []}
    for _ in range(args.steps):
        for name, runner in (("functional", fn), ("plain", plain)):
            times[name].append(_timed(runner.step, batch))
    calls = {name: call_counts(r, batch, args.profile_steps) for name, r in (("functional", fn), ("plain", plain))}

    result = {"first_loss": first, "first_loss_rel_diff": rel, "steps": args.steps, "threads": args.threads,
              "precision": args.precision}
    for name in times:
        result[name] = {"median_wall_ms": 1e3 * statistics.median(t[0] for t in times[name]),
                        "median_cpu_ms": 1e3 * statistics.median(t[1] for t in times[name]),
                        "python_calls_per_step": calls[name][0]}
    f, p = result["functional"], result["plain"]
    result["wall_ratio"] = f["median_wall_ms"] / p["median_wall_ms"]
    result["cpu_ratio"] = f["median_cpu_ms"] / p["median_cpu_ms"]
    print(f"{'':12}{'wall ms':>10}{'cpu ms':>10}{'py calls':>10}")
    for name in ("functional", "plain"):
        r = result[name]
        print(f"{name:12}{r['median_wall_ms']:10.2f}{r['median_cpu_ms']:10.2f}{r['python_calls_per_step']:10.0f}")
    print(f"ratio functional / plain: wall {result['wall_ratio']:.3f}, cpu {result['cpu_ratio']:.3f}")
    print("most-called functional_pp functions (calls per step):")
    for where, n in calls["functional"][1]:
        print(f"  {n:7.1f}  {where}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
