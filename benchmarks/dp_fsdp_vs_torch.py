"""Data parallelism against torch-native: our DP (``fpp.train_step`` on a ``dp_replicate`` mesh)
vs ``DistributedDataParallel``, and our FSDP (``dp_shard``, weights split along ``hidden``) vs
FSDP2 (``fully_shard`` on every block and on the root), on real gloo processes.

    python benchmarks/dp_fsdp_vs_torch.py                        # 2 processes, preset small
    python benchmarks/dp_fsdp_vs_torch.py --processes 4 --steps 6
    python benchmarks/dp_fsdp_vs_torch.py --preset tiny --steps 2 --warmup 1   # a smoke test

Every rank builds both sides from the same initial weights (the plain ``nn.Module`` of
``single_device.py`` loaded from the functional parameters) and the same batch rows. Steps
are interleaved (ours, torch's, ours, ...) with a barrier before each, so machine noise hits
both alike; the median step time (wall, and CPU time of the rank's process) per side and the ratio ours / torch are reported. Our DP
runs twice: ``bucket_mb=None`` (one synchronous all-reduce per gradient, the old path) and
the default buckets; our FSDP twice: ``fsdp_units=False`` (one all-gather / reduce-scatter per
weight) and the default per-layer units. The first-step losses (global means) of each pair are printed and must
agree within 1e-4 relative. Rank 0 prints one JSON line at the end. Our steps donate their state
(``donate_state=True``, as the trainer loop does and as torch's optimizers update in place:
AdamW is then one fused pass, docs/optim.md); ``--no-donate-state`` keeps the state passed in.
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

from single_device import (OPT, PRESETS, PlainLlama, load_from_functional, make_config, peak_memory,  # noqa: E402
                           plain_loss)

import functional_pp as fpp  # noqa: E402
from functional_pp.models import llama  # noqa: E402


def _adamw():
    return fpp.optim.adamw(OPT["lr"], b1=OPT["b1"], b2=OPT["b2"], eps=OPT["eps"], weight_decay=OPT["weight_decay"])


def _torch_adamw(params):
    return torch.optim.AdamW(params, lr=OPT["lr"], betas=(OPT["b1"], OPT["b2"]), eps=OPT["eps"],
                             weight_decay=OPT["weight_decay"], foreach=True)


class Ours:
    """``fpp.train_step`` on this rank."""

    def __init__(self, cfg, mesh, rules, local_batch, **step_kw):
        self.step_fn = fpp.train_step(functools.partial(llama.loss, cfg=cfg), _adamw(), mesh=mesh, rules=rules,
                                      **step_kw)
        self.state = self.step_fn.init(fpp.init(llama.init, cfg, mesh=mesh, rules=rules, seed=0))
        self.batch = local_batch

    def step(self, batch=None) -> float:
        self.state, m = self.step_fn(self.state, self.batch)
        return m["loss"]

    def live_state(self):
        return self.state


class Torch:
    """DDP or FSDP2 over the plain module; the loss is averaged over the ranks for printing."""

    def __init__(self, cfg, full_params, local_batch, seq, kind):
        import torch.distributed as dist
        model = PlainLlama(cfg, max_seq=seq)
        load_from_functional(model, full_params, cfg)
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model, self.opt, self.batch = model, _torch_adamw(model.parameters()), local_batch

    def live_state(self):
        import optree
        tree = [list(self.model.parameters()), list(self.opt.state.values())]
        # FSDP2's DTensors: count the local shards
        return optree.tree_map(lambda t: t.to_local() if hasattr(t, "to_local") else t, tree)

    def step(self, batch=None) -> float:
        import torch.distributed as dist
        loss = plain_loss(self.model, self.batch["tokens"], self.batch["labels"])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        return float(value) / dist.get_world_size()


def _timed(runner) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process (all its threads, gloo's included), loss)."""
    import torch.distributed as dist
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    loss = runner.step()
    return time.perf_counter() - t0, time.process_time() - c0, loss


def _compare(pairs: dict, steps: int, warmup: int) -> dict:
    """Interleave the runners' steps; per runner the first-step loss, the median step time and
    the peak memory of one more step (single_device.peak_memory: live state + the CPU
    allocator's high-water mark during the step, on this rank)."""
    times = {name: [] for name in pairs}
    cpu = {name: [] for name in pairs}
    first = {}
    for i in range(warmup + steps):
        for name, runner in pairs.items():
            seconds, cpu_seconds, loss = _timed(runner)
            if i == 0:
                first[name] = loss
            elif i >= warmup:
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
    peak = {}
    for name, runner in pairs.items():
        import torch.distributed as dist
        dist.barrier()
        peak[name] = peak_memory(runner, runner.batch, "cpu")["peak_bytes"]
    return {name: {"first_loss": first[name], "median_s": statistics.median(times[name]),
                   "median_cpu_s": statistics.median(cpu[name]), "peak_bytes": peak[name]}
            for name in pairs}


def device(args) -> dict:
    torch.set_num_threads(args.threads)
    n = fpp.current_mesh().size
    preset = PRESETS[args.preset]
    seq = args.seq or preset["seq"]
    per_rank = args.batch or preset["batch"]
    cfg = make_config(args.preset, seq)
    full = fpp.init(llama.init, cfg, seed=0)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, cfg.vocab, (per_rank * n, seq + 1), generator=g)
    rank = fpp.current_rank()
    rows = slice(rank * per_rank, (rank + 1) * per_rank)       # batch over one DP axis: rank-major
    local = {"tokens": ids[rows, :-1].contiguous(), "labels": ids[rows, 1:].contiguous()}
    donate = not args.no_donate_state
    if args.layout == "dp":
        mesh, rules = fpp.current_mesh(), llama.default_rules(tp=False, fsdp=False)
        return _compare({"ours_dp_unbucketed": Ours(cfg, mesh, rules, local, bucket_mb=None, donate_state=donate),
                         "ours_dp": Ours(cfg, mesh, rules, local, donate_state=donate),
                         "ddp": Torch(cfg, full, local, seq, "ddp")}, args.steps, args.warmup)
    mesh, rules = fpp.current_mesh(), llama.default_rules(tp=False)
    return _compare({"ours_fsdp_per_weight": Ours(cfg, mesh, rules, local, fsdp_units=False, donate_state=donate),
                     "ours_fsdp": Ours(cfg, mesh, rules, local, donate_state=donate),
                     "fsdp2": Torch(cfg, full, local, seq, "fsdp2")}, args.steps, args.warmup)


def summarize(res: dict, args, n: int) -> dict:
    summary = {"processes": n, "preset": args.preset, "steps": args.steps, "donate_state": not args.no_donate_state,
               "median_ms": {k: round(v["median_s"] * 1e3, 1) for k, v in res.items()},
               "median_cpu_ms": {k: round(v["median_cpu_s"] * 1e3, 1) for k, v in res.items()},
               "first_loss": {k: v["first_loss"] for k, v in res.items()},
               "peak_mib": {k: round(v["peak_bytes"] / 2**20, 1) for k, v in res.items()}}
    pairs = [("ours_dp_unbucketed", "ddp"), ("ours_dp", "ddp"), ("ours_fsdp_per_weight", "fsdp2"),
             ("ours_fsdp", "fsdp2")]
    for ours, theirs in pairs:
        if ours in res:
            a, b = res[ours], res[theirs]
            rel = abs(a["first_loss"] - b["first_loss"]) / abs(b["first_loss"])
            if rel > 1e-4:
                raise SystemExit(f"first-step losses differ: {ours} {a['first_loss']} vs {theirs} "
                                 f"{b['first_loss']} (relative {rel:.2e})")
            summary[f"{ours}/{theirs}"] = round(a["median_s"] / b["median_s"], 3)
            summary[f"{ours}/{theirs} cpu"] = round(a["median_cpu_s"] / b["median_cpu_s"], 3)
            summary[f"{ours}/{theirs} peak memory"] = round(a["peak_bytes"] / b["peak_bytes"], 3)
    return summary


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None, help="rows per process")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--layouts", default="dp,fsdp", help="comma-separated: dp, fsdp")
    ap.add_argument("--no-donate-state", action="store_true", help="our steps keep the state passed in")
    args = ap.parse_args(argv)
    args.layouts = args.layouts.split(",")
    if not set(args.layouts) <= {"dp", "fsdp"}:
        ap.error(f"--layouts: choose from dp, fsdp; got {args.layouts}")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step is not timed)")
    results = {}
    for layout in args.layouts:      # one launch per mesh: dp_replicate for DP, dp_shard for FSDP
        mesh = fpp.Mesh(dp_replicate=args.processes) if layout == "dp" else fpp.Mesh(dp_shard=args.processes)
        args.layout = layout
        results.update(fpp.launch(functools.partial(device, args), mesh, processes=True, timeout=1800)[0])
    for name, r in results.items():
        print(f"{name:20s} first-step loss {r['first_loss']:.7f}  median {r['median_s'] * 1e3:8.1f} ms  "
              f"cpu {r['median_cpu_s'] * 1e3:8.1f} ms  peak {r['peak_bytes'] / 2**20:8.1f} MiB")
    summary = summarize(results, args, args.processes)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
