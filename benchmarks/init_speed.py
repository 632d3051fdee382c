"""How fast ``fpp.init`` builds parameters, in parameters per second of one CPU core.

    python benchmarks/init_speed.py                     # Llama-3.2-1B-shaped, 4 layers (~0.37 B params)
    python benchmarks/init_speed.py --layers 16 --mesh dp_shard=8,tp=8
    python benchmarks/init_speed.py --model llama3_8b --layers 32 --mesh dp_shard=8 --shard-only

One intra-op thread. Reports the whole tree on one device, and the shards of one device of
``--mesh`` (rank 0 by default; ``--rules`` default: llama.default_rules()) counting only the
parameters that device holds. Process CPU time and wall time; one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import functional_pp as fpp
from functional_pp.models import llama


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3_1b", help="a llama.Config preset: llama3_1b, llama3_8b, ...")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shard-only", action="store_true", help="skip the whole tree on one device")
    ap.add_argument("--mesh", default="dp_shard=4,tp=2", help="axis=size,... for the sharded run")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    return ap.parse_args(argv)


def _timed(fn, repeats: int) -> tuple[float, float, object]:
    best = None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        w, c = time.perf_counter() - w0, time.process_time() - c0
        if best is None or c < best[1]:
            best = (w, c, out)
        del out
    return best


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cfg = getattr(llama.Config, args.model)(layers=args.layers)
    decls = llama.init(cfg)
    mesh = fpp.Mesh(**{k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))})
    rules = llama.default_rules()
    total = fpp.count_params(decls)

    if args.shard_only:
        wall = cpu = float("nan")
    else:
        wall, cpu, full = _timed(lambda: fpp.init_params(decls, seed=0), args.repeats)
        del full
    shard_wall, shard_cpu, shards = _timed(
        lambda: fpp.init_params(decls, seed=0, mesh=mesh, rules=rules, rank=args.rank), args.repeats)
    local = sum(t.numel() for _, t in fpp.leaves_with_paths(shards))
    out = {"model": f"{args.model} shape, {args.layers} layers", "params": total,
           "full": {"wall_s": wall, "cpu_s": cpu, "params_per_cpu_s": total / cpu},
           "shard": {"mesh": repr(mesh), "rank": args.rank, "params": local, "wall_s": shard_wall,
                     "cpu_s": shard_cpu, "params_per_cpu_s": local / shard_cpu}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
