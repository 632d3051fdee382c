"""FSDP step time over an artificially slow link: how much communication the eager step hides
behind computation, with and without prefetching the next FSDP unit (issue 10 item 5).

    python benchmarks/slow_link.py                          # 2 gloo processes, 20 ms per collective
    python benchmarks/slow_link.py --link-ms 50 --mbps 200  # latency and bandwidth
    python benchmarks/slow_link.py --preset tiny --steps 2 --warmup 1   # a smoke test

Each process's ``torch.distributed`` backend delays every eager collective as a link that
carries one collective at a time would (``FPP_SLOW_LINK_MS`` / ``FPP_SLOW_LINK_MBPS``,
functional_pp/devices/slow_link.py): a synchronous collective blocks until it is through,
an asynchronous one (a prefetched unit gather, a unit's gradient reduce-scatter) only when
its result is awaited. The same
FSDP step (``dp_shard`` over the processes, weights split along ``hidden``, per-layer units)
runs with ``fsdp_prefetch=False`` (each unit gathered when its layer starts, re-gathered
when its backward starts) and ``fsdp_prefetch=True`` (the next unit's gather launched
before the current one computes, forward and backward, and each unit's gradient
reduce-scatter launched asynchronously, awaited before the optimizer), interleaved step by step from the
same weights and batch; optionally also per-weight collectives (``fsdp_units=False``), and
``no_link``: the prefetching step with the link's delay switched off in the same processes
(compute and real communication only). Prints per variant the first-step loss (equal:
prefetch does not change the numbers), the median step time, the collectives per step and
how much of their link time (collectives x latency) the step exposes (its time minus
``no_link``'s), then one JSON line (rank 0).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import functional_pp as fpp  # noqa: E402
from functional_pp.core.runtime import current_context  # noqa: E402
from functional_pp.devices.slow_link import ENV_MBPS, ENV_MS  # noqa: E402
from functional_pp.models import llama  # noqa: E402

PRESETS = {
    "tiny": dict(model=dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128), batch=2, seq=32),
    # layers whose compute (a few tens of ms per layer on one CPU thread) can cover a 20 ms link
    "medium": dict(model=dict(vocab=2048, hidden=256, layers=4, heads=4, kv_heads=2, mlp=704), batch=4, seq=128),
}
VARIANTS = {"no_prefetch": dict(fsdp_prefetch=False), "prefetch": dict(fsdp_prefetch=True),
            "per_weight": dict(fsdp_units=False),
            "no_link": dict(fsdp_prefetch=True)}    # the same step with the link's delay off: compute only


def _runner(cfg, mesh, rules, batch, **step_kw):
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-3), mesh=mesh,
                          rules=rules, **step_kw)
    state = {"s": step.init(fpp.init(llama.init, cfg, mesh=mesh, rules=rules, seed=0))}

    def run() -> float:
        state["s"], m = step(state["s"], batch)
        return m["loss"]
    return run


def device(args) -> dict:
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    mesh, rules = fpp.current_mesh(), llama.default_rules(tp=False)
    preset = PRESETS[args.preset]
    cfg = llama.Config.tiny(**preset["model"])
    per_rank, seq = preset["batch"], preset["seq"]
    ids = torch.randint(0, cfg.vocab, (per_rank * mesh.size, seq + 1), generator=torch.Generator().manual_seed(1))
    rows = slice(fpp.current_rank() * per_rank, (fpp.current_rank() + 1) * per_rank)
    batch = {"tokens": ids[rows, :-1].contiguous(), "labels": ids[rows, 1:].contiguous()}
    runners = {name: _runner(cfg, mesh, rules, batch, **VARIANTS[name]) for name in args.variants}
    backend = current_context().backend
    link = backend.link
    times = {name: [] for name in runners}
    first, collectives = {}, {}
    for i in range(args.warmup + args.steps):
        for name, run in runners.items():          # interleaved: machine noise hits all alike
            backend.link = None if name == "no_link" else link
            dist.barrier()
            with fpp.comm_report() as report:
                t0 = time.perf_counter()
                loss = run()
                seconds = time.perf_counter() - t0
            collectives[name] = len(report.events)
            if i == 0:
                first[name] = loss
            elif i >= args.warmup:
                times[name].append(seconds)
    backend.link = link
    return {name: {"first_loss": first[name], "median_s": statistics.median(times[name]),
                   "collectives": collectives[name]} for name in runners}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    ap.add_argument("--link-ms", type=float, default=20.0, help="latency per collective (ms)")
    ap.add_argument("--mbps", type=float, default=None, help="link bandwidth (MB/s; default: infinite)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (the first records the unit order)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--variants", default="no_prefetch,prefetch,no_link",
                    help=f"comma-separated: {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    args.variants = args.variants.split(",")
    if not set(args.variants) <= set(VARIANTS) or not args.variants:
        ap.error(f"--variants: choose from {', '.join(VARIANTS)}; got {args.variants}")
    if args.warmup < 2:
        ap.error("--warmup must be >= 2 (the first step compiles nothing but records the order "
                 "prefetch replays; the second is the first prefetched one)")
    if args.link_ms < 0 or (args.mbps is not None and args.mbps <= 0):
        ap.error("--link-ms must be >= 0 and --mbps > 0")
    os.environ[ENV_MS] = str(args.link_ms)          # read by each forked rank's backend
    if args.mbps is not None:
        os.environ[ENV_MBPS] = str(args.mbps)
    try:
        res = fpp.launch(functools.partial(device, args), fpp.Mesh(dp_shard=args.processes), processes=True,
                         timeout=1800)[0]
    finally:
        os.environ.pop(ENV_MS, None)
        os.environ.pop(ENV_MBPS, None)
    base = res.get("no_link", {}).get("median_s")
    for name, r in res.items():
        extra = "" if base is None or name == "no_link" else \
            f"  link exposed {(r['median_s'] - base) * 1e3:7.1f} ms of {r['collectives'] * args.link_ms:.0f}"
        print(f"{name:12s} first-step loss {r['first_loss']:.7f}  median {r['median_s'] * 1e3:8.1f} ms  "
              f"{r['collectives']:3d} collectives{extra}")
    losses = {r["first_loss"] for r in res.values()}
    if len(losses) != 1:
        raise SystemExit(f"first-step losses differ between variants: {res}")
    summary = {"processes": args.processes, "preset": args.preset, "link_ms": args.link_ms, "mbps": args.mbps,
               "steps": args.steps, "first_loss": losses.pop(),
               "median_ms": {k: round(v["median_s"] * 1e3, 1) for k, v in res.items()},
               "collectives": {k: v["collectives"] for k, v in res.items()}}
    if base is not None:
        summary["exposed_link_ms"] = {k: round((v["median_s"] - base) * 1e3, 1) for k, v in res.items()
                                      if k != "no_link"}
    if "prefetch" in res and "no_prefetch" in res:
        summary["prefetch/no_prefetch"] = round(res["prefetch"]["median_s"] / res["no_prefetch"]["median_s"], 3)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
