"""Per-kernel profile of the compiled single-device step, ours against plain torch's, side by
side: the models, batch and optimizers of ``benchmarks/single_device.py``, both compiled with
inductor, one thread.

    python benchmarks/kernel_profile.py                       # preset small
    python benchmarks/kernel_profile.py --kernels             # also every profiled kernel
    python benchmarks/kernel_profile.py --isolated 30         # each linear's matmuls, both layouts
    python benchmarks/kernel_profile.py --json prof.json

Three tables (docs/compile.md, "Measurements"):

* **Unprofiled**: ``--timed-steps`` steps of each side, interleaved, process CPU time per step
  (median), minor page faults and system time per step, and the time of every matrix product
  the compiled graphs call, taken by wrapping inductor's ``extern_kernels.mm``/``addmm``/``bmm``
  (no profiler), grouped by problem: the contracted size K and the two outer sizes, so that
  ``C = A B`` and its transpose ``C^T = B^T A^T`` (how an ``[in, out]`` and an ``[out, in]``
  weight compute the same weight gradient) share a row, with each side's transposes (``N``
  row-major, ``T`` a transposed view, as MKL sees them).
* **Profiled**: ``torch.profiler`` around ``--steps`` steps of each side with inductor's
  ``cpp.enable_kernel_profile`` (every generated C++ kernel is an event), self CPU ms per step
  (mean), grouped so that equivalent work lines up: attention (SDPA's CPU flash kernels), the
  inductor kernels by their fused ops (the loss, RMSNorm, rotary, SwiGLU, the embedding's
  backward, the optimizer; ours fuses the embedding's backward into the update kernel), the
  compiled graphs' call overhead. Shapes are not recorded: ``record_shapes=True`` added 5-20 %
  to the plain side's matmuls.
* ``--isolated ROUNDS``: instead of the step, each linear layer's three products (forward,
  input gradient, weight gradient) with the weight ``[in, out]`` (ours) and ``[out, in]``
  (``nn.Linear``), into preallocated outputs, the two forms interleaved with the first of each
  pair alternating (the second finds warm caches).

The whole-step figures move by several per cent between runs on a shared machine (page faults,
other load): state the load average (printed) with any number taken from here.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from single_device import OPT, PRESETS, FunctionalRunner, PlainRunner, make_batch, make_config  # noqa: E402

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


def classify(event) -> tuple[str, str]:
    """(group, row) of one profiler event (matmuls are timed without the profiler, ``MatmulTimer``)."""
    name = event.name
    if name in MATMULS:
        return "matmul (profiled)", name
    if any(a in name for a in ATTENTION):
        return "attention", name
    if re.match(r"(graph_\d+_)?cpp_", name):
        return kernel_group(name), name
    if any(g in name for g in GRAPH_CALL):
        return "graph call", name
    return "other ops", name


class MatmulTimer:
    """Process CPU time of every matrix product the compiled graphs call, without the profiler:
    inductor's wrapper code calls ``extern_kernels.mm`` / ``addmm`` / ``bmm`` by attribute at run
    time, so wrapping them times each call (the profiler's own bookkeeping inflated the plain
    side's matmuls by 5-20 %: docs/compile.md "Measuring on this machine"). Keyed by problem and
    transposes."""

    def __init__(self):
        from torch._inductor.select_algorithm import extern_kernels
        self.ns, self.side, self.steps = extern_kernels, None, collections.Counter()
        self.ms = collections.defaultdict(float)
        self.saved = {name: getattr(extern_kernels, name) for name in ("mm", "addmm", "bmm")}

    def __enter__(self):
        for name, fn in self.saved.items():
            setattr(self.ns, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.ns, name, fn)

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            c0 = time.process_time()
            out = fn(*args, **kw)
            seconds = time.process_time() - c0
            ops = [a for a in args if isinstance(a, torch.Tensor)]
            if name == "addmm":
                ops = ops[1:]
            problem, detail = matmul_key("aten::" + name, [list(t.shape) for t in ops[:2]],
                                         [list(t.stride()) for t in ops[:2]])
            self.ms[(self.side, problem, detail)] += seconds * 1e3
            return out
        return timed

    def step(self, runner, batch) -> tuple[float, int, float]:
        """One unprofiled step of ``runner``: its process CPU seconds, minor page faults and
        system CPU seconds (first touches of memory the allocator mapped afresh)."""
        self.side = runner.name
        self.steps[runner.name] += 1
        u0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        runner.step(batch)
        seconds, u1 = time.process_time() - c0, resource.getrusage(resource.RUSAGE_SELF)
        return seconds, u1.ru_minflt - u0.ru_minflt, u1.ru_stime - u0.ru_stime


def profile_side(runner, batch, steps: int, table: dict) -> None:
    """Adds the self CPU ms of one profiled step per event to ``table[(group, row)]``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step(batch)
    for e in prof.events():
        table[classify(e)] += e.self_cpu_time_total / 1e3 / steps


def isolated_matmuls(cfg, tokens: int, rounds: int) -> dict:
    """The three matrix products of every linear layer of ``cfg`` (forward ``x @ W``, input
    gradient ``dy @ W^T``, weight gradient) with the weight stored ``[in, out]`` (ours) and
    ``[out, in]`` (``nn.Linear``), each into a preallocated output (no allocation, no page
    faults), the forms interleaved ``rounds`` times, alternating which of a pair runs first;
    median process CPU ms per product."""
    d, h = cfg.dim_head, cfg.hidden
    linears = {"q_proj, o_proj": (h, cfg.heads * d), "k_proj, v_proj": (h, cfg.kv_heads * d),
               "gate_proj, up_proj": (h, cfg.mlp), "down_proj": (cfg.mlp, h), "lm_head": (h, cfg.vocab)}
    out = {}
    for name, (n_in, n_out) in linears.items():
        x, dy = torch.randn(tokens, n_in), torch.randn(tokens, n_out)
        w = torch.randn(n_in, n_out)                    # ours: [in, out]
        wt = w.T.contiguous()                           # nn.Linear: [out, in]
        y, dx, dw, dwt = (torch.empty(tokens, n_out), torch.empty(tokens, n_in), torch.empty(n_in, n_out),
                          torch.empty(n_out, n_in))
        forms = {("forward", "ours"): lambda: torch.mm(x, w, out=y),
                 ("forward", "plain"): lambda: torch.mm(x, wt.T, out=y),
                 ("input grad", "ours"): lambda: torch.mm(dy, w.T, out=dx),
                 ("input grad", "plain"): lambda: torch.mm(dy, wt, out=dx),
                 ("weight grad", "ours"): lambda: torch.mm(x.T, dy, out=dw),
                 ("weight grad", "plain"): lambda: torch.mm(dy.T, x, out=dwt)}
        times = collections.defaultdict(list)
        for f in forms.values():
            f()
        items = list(forms.items())
        for i in range(rounds):     # alternate who goes first: the second of a pair finds warm caches
            for key, f in (items if i % 2 == 0 else [kv for pair in zip(items[1::2], items[::2]) for kv in pair]):
                c0 = time.process_time()
                f()
                times[key].append((time.process_time() - c0) * 1e3)
        out[name] = {key: statistics.median(v) for key, v in times.items()}
    return out


def print_isolated(cfg, tokens: int, rounds: int) -> dict:
    res = isolated_matmuls(cfg, tokens, rounds)
    per_layer = {"q_proj, o_proj": 2, "k_proj, v_proj": 2, "gate_proj, up_proj": 2, "down_proj": 1}
    print(f"isolated matmuls, {tokens} tokens, median of {rounds} interleaved rounds, process CPU ms per product "
          f"(weight [in, out] = ours, [out, in] = nn.Linear)")
    print(f"{'linear':20s} {'product':12s} {'ours':>8s} {'plain':>8s} {'ours-plain':>11s}")
    total = collections.defaultdict(float)
    for name, t in res.items():
        count = per_layer.get(name, 0) * cfg.layers or 1
        for product in ("forward", "input grad", "weight grad"):
            o, p = t[(product, "ours")], t[(product, "plain")]
            total["ours"] += count * o
            total["plain"] += count * p
            print(f"{name:20s} {product:12s} {o:8.2f} {p:8.2f} {o - p:+11.2f}")
    print(f"per step (x layers, x uses): ours {total['ours']:.1f} ms, plain {total['plain']:.1f} ms, "
          f"{total['ours'] - total['plain']:+.1f} ms")
    return {"isolated": {name: {f"{k[0]}|{k[1]}": v for k, v in t.items()} for name, t in res.items()},
            "isolated_per_step": dict(total)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per side (mean)")
    ap.add_argument("--timed-steps", type=int, default=6,
                    help="unprofiled steps per side first: whole-step and matmul process CPU time")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per side first (the first compiles)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", action="store_true", help="also list every profiled event of each side")
    ap.add_argument("--isolated", type=int, default=0, metavar="ROUNDS",
                    help="instead: time each linear layer's three matmuls in both weight layouts in isolation")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.isolated:
        preset = PRESETS[args.preset]
        load0 = os.getloadavg()
        result = print_isolated(make_config(args.preset, preset["seq"]), preset["batch"] * preset["seq"],
                                args.isolated)
        print(f"load average {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return result
    import torch._inductor.config as icfg
    icfg.cpp.enable_kernel_profile = True

    preset = PRESETS[args.preset]
    cfg = make_config(args.preset, preset["seq"])
    load0 = os.getloadavg()
    params = fpp.init(llama.init, cfg, seed=0)
    batch = make_batch(cfg, preset["batch"], preset["seq"], "cpu")
    runners = [FunctionalRunner(cfg, params, True, "fp32", "cpu"),
               PlainRunner(cfg, params, True, "fp32", "cpu", preset["seq"])]
    names = [r.name for r in runners]
    losses = {n: [] for n in names}
    for _ in range(max(args.warmup, 2)):
        for r in runners:
            losses[r.name].append(float(r.step(batch)))
    print(f"preset {args.preset}, {args.threads} thread(s), AdamW {OPT}; losses of the first two steps: "
          + "; ".join(f"{n} {v[0]:.7f} {v[1]:.7f}" for n, v in losses.items()))
    step_s, faults, sys_s = ({n: [] for n in names} for _ in range(3))
    with MatmulTimer() as mm:
        for i in range(args.timed_steps):
            for r in (runners if i % 2 == 0 else runners[::-1]):
                seconds, n_faults, system = mm.step(r, batch)
                step_s[r.name].append(seconds)
                faults[r.name].append(n_faults)
                sys_s[r.name].append(system)
    tables = {n: collections.defaultdict(float) for n in names}
    for i in range(args.steps):
        for r in (runners if i % 2 == 0 else runners[::-1]):
            profile_side(r, batch, args.steps, tables[r.name])
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at end")

    width = 40
    step_ms = {n: statistics.median(v) * 1e3 for n, v in step_s.items()}
    mm_ms = {n: sum(ms for (side, _, _), ms in mm.ms.items() if side == n) / max(mm.steps[n], 1) for n in names}
    print(f"\nunprofiled, process CPU ms per step ({args.timed_steps} steps each, interleaved; matmuls: "
          f"inductor's extern mm calls, timed)")
    print(f"{'':{width}s} {'ours':>9s} {'plain':>9s} {'ours-plain':>11s}")
    for label, d in (("whole step (median)", step_ms), ("matmuls (mean)", mm_ms),
                     ("everything else", {n: step_ms[n] - mm_ms[n] for n in names})):
        print(f"{label:{width}s} {d['functional']:9.2f} {d['plain']:9.2f} {d['functional'] - d['plain']:+11.2f}")
    fault_med = {n: statistics.median(faults[n]) for n in names}
    sys_med = {n: statistics.median(sys_s[n]) * 1e3 for n in names}
    print(f"{'  of which system time (median)':{width}s} {sys_med['functional']:9.2f} {sys_med['plain']:9.2f} "
          f"{sys_med['functional'] - sys_med['plain']:+11.2f}")
    print(f"{'minor page faults per step (median)':{width}s} {fault_med['functional']:9.0f} "
          f"{fault_med['plain']:9.0f} {fault_med['functional'] - fault_med['plain']:+11.0f}")
    print(f"ratio ours / plain: whole step {step_ms['functional'] / step_ms['plain']:.3f}")
    print("\nmatmuls by problem (K = contracted size; transposes as MKL sees them: N row-major, T transposed), "
          "ms per step")
    problems = sorted({p for (_, p, _) in mm.ms})
    for problem in problems:
        per = {n: sum(ms for (side, p, _), ms in mm.ms.items() if side == n and p == problem) / max(mm.steps[n], 1)
               for n in names}
        forms = {n: ", ".join(sorted({d for (side, p, d) in mm.ms if side == n and p == problem})) for n in names}
        print(f"  {problem:{width - 2}s} {per['functional']:9.2f} {per['plain']:9.2f} "
              f"{per['functional'] - per['plain']:+11.2f}   ours {forms['functional']} | plain {forms['plain']}")

    order = ["matmul (profiled)", "attention", "loss", "rms_norm", "rotary", "swiglu", "embedding", "optimizer",
             "other kernels", "graph call", "other ops"]
    print(f"\nprofiled (torch.profiler, inductor kernel profile), self CPU ms per step, mean of {args.steps} steps")
    print(f"{'group':{width}s} {'ours':>9s} {'plain':>9s} {'ours-plain':>11s}")
    ours, plain = tables["functional"], tables["plain"]
    for group in order:
        go = sum(ms for (g, _), ms in ours.items() if g == group)
        gp = sum(ms for (g, _), ms in plain.items() if g == group)
        print(f"{group:{width}s} {go:9.2f} {gp:9.2f} {go - gp:+11.2f}")
    to, tp = sum(ours.values()), sum(plain.values())
    print(f"{'total (all events)':{width}s} {to:9.2f} {tp:9.2f} {to - tp:+11.2f}")
    if args.kernels:
        for n in names:
            print(f"\n{n}: every profiled event (ms per step)")
            for (g, row), ms in sorted(tables[n].items(), key=lambda kv: (order.index(kv[0][0]), -kv[1])):
                if ms >= 0.05:
                    print(f"  {g:17s} {ms:8.2f}  {row[:150]}")
    result = {"preset": args.preset, "threads": args.threads, "loadavg_start": load0, "loadavg_end": load1,
              "losses": losses, "step_ms": step_ms, "matmul_ms": mm_ms, "faults": fault_med, "sys_ms": sys_med,
              "matmuls": {f"{side}|{p}|{d}": ms / max(mm.steps[side], 1) for (side, p, d), ms in mm.ms.items()},
              "profiled": {n: {f"{g}|{r}": ms for (g, r), ms in t.items()} for n, t in tables.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
