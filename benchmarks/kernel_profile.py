"""Per-kernel profile of the compiled single-device step, ours against plain torch's, side by
side: the models, batch and optimizers of ``benchmarks/single_device.py``, both compiled with
inductor, one thread, inductor's ``cpp.enable_kernel_profile`` (every generated C++ kernel is a
profiler event), ``torch.profiler`` around ``--steps`` steps of each side (interleaved), self
CPU time per kernel in ms per step (the mean over the profiled steps).

    python benchmarks/kernel_profile.py                       # preset small, 3 profiled steps
    python benchmarks/kernel_profile.py --kernels             # also every kernel of each side
    python benchmarks/kernel_profile.py --json prof.json

Kernels are grouped so that equivalent work of the two sides lines up (docs/compile.md,
"Sixth round"): the matmuls by problem (contracted size K and the two outer sizes, so that
``C = A B`` and its transpose ``C^T = B^T A^T``, how a ``[in, out]`` and an ``[out, in]``
weight compute the same weight gradient, share a row), each with its operands' transposes
(``N`` row-major, ``T`` a transposed view, as MKL sees them); attention (SDPA's CPU flash
kernels); and the inductor kernels by what their fused ops say (the loss, RMSNorm, rotary,
SwiGLU, the embedding, the optimizer), with the compiled graphs' call overhead (the self time
of the compiled-region events) and everything else. Timing is per kernel, so it is far less
sensitive to other load than the whole-step ratio, but a busy machine still slows memory-bound
loops: state the load average (printed) with any number taken from here.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from single_device import (OPT, PRESETS, FunctionalRunner, PlainRunner, make_batch,  # noqa: E402
                           make_config)

import functional_pp as fpp  # noqa: E402
from functional_pp.models import llama  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkl_linear", "mkldnn::_linear_pointwise",
           "aten::matmul")
ATTENTION = ("flash_attention", "scaled_dot_product", "_efficient_attention")
# graph-call events: their self time is the compiled graph's host code (wrapper, allocation)
GRAPH_CALL = ("Torch-Compiled Region", "CompiledFunction", "CompiledFxGraph", "## Call CompiledFxGraph",
              "TorchDynamo Cache Lookup", "## Guard", "Call CompiledFxGraph")

# inductor kernel name -> group: the first rule whose words are all among the kernel's fused ops
# (the words of ``graph_<g>_cpp_fused_<op>_<op>..._<n>``); a kernel fusing several kinds of work
# counts in the first group that matches (ours fuses the embedding's backward into the update)
KERNEL_GROUPS = (
    ("optimizer", ("foreach",)),
    ("loss", ("softmax",), ("nll",), ("logsumexp",)),
    ("swiglu", ("silu",)),
    ("rotary", ("roll",), ("cat", "neg"), ("cos",), ("clone", "transpose")),
    ("embedding", ("embedding", "dense", "backward")),
    ("rms_norm", ("rsqrt",), ("pow", "sum"), ("mul", "sum")),
)


def kernel_group(name: str) -> str:
    """The group of an inductor kernel by its fused ops (see ``KERNEL_GROUPS``)."""
    words = set(re.sub(r"^(graph_\d+_)?cpp_fused_|_\d+$", "", name).split("_"))
    for group, *rules in KERNEL_GROUPS:
        if any(all(w in words for w in rule) for rule in rules):
            return group
    return "other kernels"


def _transposes(shapes, strides) -> str:
    flags = []
    for shape, stride in zip(shapes, strides):
        if len(shape) < 2 or not stride:
            continue
        rows, cols = stride[-2], stride[-1]
        flags.append("N" if cols == 1 and rows >= shape[-1] else "T" if rows == 1 else "S")
    return "".join(flags)


def matmul_key(name: str, shapes, strides) -> tuple[str, str]:
    """(problem, transposes): the problem ``K=<k> {m, n}`` shared by C = A B and C^T = B^T A^T."""
    shapes = [s for s in shapes if s]
    if name == "aten::addmm":          # bias, a, b
        shapes, strides = shapes[1:3], strides[1:3]
    if len(shapes) < 2 or len(shapes[0]) < 2:
        return f"{name} {shapes}", ""
    a, b = shapes[0], shapes[1]
    batch = "x".join(str(d) for d in a[:-2])
    m, k, n = a[-2], a[-1], b[-1]
    lo, hi = sorted((m, n))
    problem = f"{'bmm ' + batch + ' ' if batch else ''}K={k} {{{lo}, {hi}}}"
    return problem, f"{m}x{k}@{k}x{n} {_transposes(shapes[:2], strides[:2])}"


def classify(event) -> tuple[str, str, str]:
    """(group, row, detail) of one profiler event."""
    name = event.name
    if name in MATMULS:
        strides = getattr(event, "structured_input_strides", None) or [[] for _ in event.input_shapes]
        problem, detail = matmul_key(name, event.input_shapes, strides)
        return "matmul", problem, detail
    if any(a in name for a in ATTENTION):
        return "attention", name, ""
    if re.match(r"(graph_\d+_)?cpp_", name):
        return kernel_group(name), name, ""
    if any(g in name for g in GRAPH_CALL):
        return "graph call", name, ""
    return "other ops", name, ""


def profile_side(runner, batch, steps: int, table: dict, kernels: dict) -> None:
    """Adds the self CPU ms of one profiled step per event to ``table[(group, row)]``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        runner.step(batch)
    for e in prof.events():
        group, row, detail = classify(e)
        ms = e.self_cpu_time_total / 1e3 / steps
        table[(group, row)] += ms
        kernels[(group, row, detail or e.name)] += ms


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per side (mean)")
    ap.add_argument("--warmup", type=int, default=3, help="unprofiled steps per side first (the first compiles)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", action="store_true", help="also list every kernel / matmul of each side")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import torch._inductor.config as icfg
    icfg.cpp.enable_kernel_profile = True

    preset = PRESETS[args.preset]
    cfg = make_config(args.preset, preset["seq"])
    load0 = os.getloadavg()
    params = fpp.init(llama.init, cfg, seed=0)
    batch = make_batch(cfg, preset["batch"], preset["seq"], "cpu")
    runners = [FunctionalRunner(cfg, params, True, "fp32", "cpu"),
               PlainRunner(cfg, params, True, "fp32", "cpu", preset["seq"])]
    losses = {r.name: [] for r in runners}
    for _ in range(max(args.warmup, 2)):
        for r in runners:
            losses[r.name].append(float(r.step(batch)))
    print(f"preset {args.preset}, {args.threads} thread(s), AdamW {OPT}; losses of the first two steps: "
          + "; ".join(f"{n} {v[0]:.7f} {v[1]:.7f}" for n, v in losses.items()))
    tables = {r.name: collections.defaultdict(float) for r in runners}
    kernels = {r.name: collections.defaultdict(float) for r in runners}
    for i in range(args.steps):
        for r in (runners if i % 2 == 0 else runners[::-1]):
            profile_side(r, batch, args.steps, tables[r.name], kernels[r.name])
    load1 = os.getloadavg()
    ours, plain = tables["functional"], tables["plain"]
    print(f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at end; self CPU ms per step, "
          f"mean of {args.steps} profiled steps")
    order = ["matmul", "attention", "loss", "rms_norm", "rotary", "swiglu", "embedding", "optimizer",
             "other kernels", "graph call", "other ops"]
    width = 44
    print(f"\n{'group / row':{width}s} {'ours':>9s} {'plain':>9s} {'ours-plain':>11s}")
    totals = collections.defaultdict(float)
    for group in order:
        rows = sorted({row for g, row in list(ours) + list(plain) if g == group})
        go, gp = sum(ours[(group, r)] for r in rows), sum(plain[(group, r)] for r in rows)
        totals["ours"] += go
        totals["plain"] += gp
        print(f"{group:{width}s} {go:9.2f} {gp:9.2f} {go - gp:+11.2f}")
        if group == "matmul":
            for row in rows:
                o, p = ours[(group, row)], plain[(group, row)]
                flags = {side: sorted({d for (g, rw, d) in kernels[side] if g == group and rw == row})
                         for side in kernels}
                print(f"  {row:{width - 2}s} {o:9.2f} {p:9.2f} {o - p:+11.2f}   ours {', '.join(flags['functional'])}"
                      f" | plain {', '.join(flags['plain'])}")
    print(f"{'total (all events)':{width}s} {totals['ours']:9.2f} {totals['plain']:9.2f} "
          f"{totals['ours'] - totals['plain']:+11.2f}")
    if args.kernels:
        for side in kernels:
            print(f"\n{side}: every kernel (ms per step)")
            for (g, row, d), ms in sorted(kernels[side].items(), key=lambda kv: (order.index(kv[0][0]), -kv[1])):
                if ms >= 0.05:
                    print(f"  {g:14s} {ms:8.2f}  {row}  {d if d != row else ''}")
    result = {"preset": args.preset, "threads": args.threads, "steps": args.steps, "loadavg_start": load0,
              "loadavg_end": load1, "losses": losses,
              "groups": {side: {f"{g}|{r}": ms for (g, r), ms in t.items()} for side, t in tables.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
