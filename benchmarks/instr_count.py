"""Deterministic cost of one compiled training step: instructions executed (callgrind), ours
against plain torch's, per side and per function/kernel.

Wall and CPU time on a shared 2-core machine move by +-4 % between runs, more than the gap
that is left (docs/compile.md "Measurements"). Instruction counts of the same step are the same
on every run, whatever else the machine does. This tool runs ``benchmarks/single_device.py``'s
two steps (``fpp.train_step(compile=True)`` and plain ``torch.compile`` of an ``nn.Module`` +
``AdamW(foreach=True).step``, same weights, first-step losses checked equal) in ONE process
under ``valgrind --tool=callgrind --instr-atstart=no``: imports, compilation and warmup steps
run uninstrumented; the instrumentation is switched on (callgrind client requests, from a tiny C
shim loaded with ctypes) only around single steps, alternately ours and plain's, and each step's
counts are dumped to their own file. Then it prints per step the total instructions (Ir) and,
with ``--cache-sim``, simulated first-level and last-level data misses (D1mr+D1mw, DLmr+DLmw),
and per function the instructions where the two sides differ most, grouped:

* inductor kernels (``cpp_fused_*`` in the generated .so; the names say what they fuse),
* every other function by name (ATen, MKL/oneDNN GEMM, the allocator, libc, Python).

    python benchmarks/instr_count.py --preset small --batch 1 --seq 128   # about 10 min
    python benchmarks/instr_count.py --preset tiny --top 30 --cache-sim
    python benchmarks/instr_count.py --annotate DIR                        # re-read old dumps

Caveats: valgrind executes AVX2 code (it does not emulate AVX-512, so MKL, oneDNN and
inductor's kernels take their AVX2 paths under it: the counts describe that build of the
step, whose structure, not absolute speed, is what is compared); everything runs on one thread
(``torch.set_num_threads(1)``); page faults and system time are not counted (they happen in
the kernel). Instructions are not time: a load that misses the caches costs more than an
add, which is what ``--cache-sim`` is for.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

# one thread, and every library on its AVX2 code (valgrind 3.19 does not execute AVX-512, though
# its CPUID lets torch see it): ATen's kernels, MKL, oneDNN and inductor's C++ (-march, simdlen)
AVX2_ENV = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"}

SHIM_C = r"""
#include <valgrind/callgrind.h>
int fpp_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
void fpp_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void fpp_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void fpp_zero(void) { CALLGRIND_ZERO_STATS; }
void fpp_dump(const char *s) { CALLGRIND_DUMP_STATS_AT(s); }
"""


def build_shim(directory: str) -> str:
    """Compile the client-request shim (needs gcc and valgrind's headers)."""
    src, lib = os.path.join(directory, "cg_shim.c"), os.path.join(directory, "cg_shim.so")
    with open(src, "w") as f:
        f.write(SHIM_C)
    if not os.path.exists("/usr/include/valgrind/callgrind.h"):
        raise SystemExit("valgrind's headers (/usr/include/valgrind/callgrind.h) are missing: install "
                         "valgrind (apt-get install valgrind) to use benchmarks/instr_count.py")
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", src, "-o", lib], check=True)
    return lib


# --------------------------------------------------------------------------- capture, natively
@contextmanager
def captured_calls(into: list):
    """Record every compiled graph run inside the block: its output-code file and a copy of its
    inputs (taken before the run, which may write into them: donated state)."""
    import torch
    from torch._inductor.output_code import CompiledFxGraph
    original = CompiledFxGraph.__call__

    def recording(self, inputs):
        fn = self.current_callable
        path = getattr(fn, "__globals__", {}).get("__file__")
        into.append((path, [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs]))
        return original(self, inputs)
    CompiledFxGraph.__call__ = recording
    try:
        yield into
    finally:
        CompiledFxGraph.__call__ = original


def capture(args) -> None:
    """Natively: compile both steps, warm them up, then save what one step of each runs (the
    output code of every compiled graph it calls, with that call's real inputs)."""
    import torch
    import torch._inductor.config as inductor_config
    torch.set_num_threads(1)
    inductor_config.cpp.simdlen = 256          # AVX2 kernels: valgrind does not run AVX-512
    import single_device as sd

    import functional_pp as fpp
    from functional_pp.models import llama

    preset = sd.PRESETS[args.preset]
    batch_n, seq = args.batch or preset["batch"], args.seq or preset["seq"]
    cfg = sd.make_config(args.preset, seq)
    params = fpp.init(llama.init, cfg, seed=0)
    batch = sd.make_batch(cfg, batch_n, seq, "cpu")
    runners = {"functional": sd.FunctionalRunner(cfg, params, True, "fp32", "cpu"),
               "plain": sd.PlainRunner(cfg, params, True, "fp32", "cpu", seq)}
    losses = {name: [r.step(batch) for _ in range(args.warmup)] for name, r in runners.items()}
    lf, lp = losses["functional"][0], losses["plain"][0]
    print(f"[instr_count] first-step loss functional {lf:.7f} plain {lp:.7f}", flush=True)
    if abs(lf - lp) > 1e-4 * abs(lp):
        raise SystemExit(f"first-step losses differ: functional {lf} vs plain {lp}")
    steps = {}
    for name, r in runners.items():
        with captured_calls([]) as calls:
            r.step(batch)
        if not calls or any(path is None for path, _ in calls):
            raise SystemExit(f"{name}: no compiled graph (or one without output code) ran in a step")
        steps[name] = calls
        print(f"[instr_count] {name}: {len(calls)} compiled graph(s) per step: "
              + ", ".join(os.path.basename(p) for p, _ in calls), flush=True)
    torch.save(steps, os.path.join(args.out, "steps.pt"))
    with open(os.path.join(args.out, "output_code.json"), "w") as f:
        json.dump(sorted({p for calls in steps.values() for p, _ in calls}), f)


# --------------------------------------------------------------------------- inside valgrind
def load_graph_modules(step_lists) -> dict:
    """The captured steps' output-code modules, each loaded once: ``{path: module}`` for every
    ``(path, inputs)`` call of every list in ``step_lists``."""
    import importlib.util
    modules = {}
    for calls in step_lists:
        for path, _ in calls:
            if path not in modules:
                spec = importlib.util.spec_from_file_location(f"graph_{len(modules)}", path)
                modules[path] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(modules[path])
    return modules


def replay(args) -> None:
    """Under callgrind: load the saved output code and inputs, run each side's graphs once
    uninstrumented, then count single steps alternately."""
    import torch
    torch.set_num_threads(1)
    import functional_pp  # noqa: F401  (registers the fpp:: custom ops the output code calls)
    shim = ctypes.CDLL(args.shim)
    if not shim.fpp_on_valgrind():
        raise SystemExit("--replay must run under valgrind --tool=callgrind (run without it)")
    steps = torch.load(os.path.join(args.out, "steps.pt"), weights_only=False)
    modules = load_graph_modules(steps.values())

    def fresh(calls):
        return [(modules[p], [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]) for p, inputs in calls]

    for name, calls in steps.items():              # once, uninstrumented (first-touch, lazy init)
        for mod, inputs in fresh(calls):
            mod.call(inputs)
    order = ["functional", "plain"]
    for i in range(args.repeats):
        for name in (order if i % 2 == 0 else order[::-1]):
            runs = fresh(steps[name])
            shim.fpp_zero()
            shim.fpp_start()
            for mod, inputs in runs:
                mod.call(inputs)
            shim.fpp_stop()
            shim.fpp_dump(f"{name}-{i}".encode())
            runs = None
            print(f"[instr_count] counted {name} step {i}", flush=True)


# --------------------------------------------------------------------------- reading the dumps
_ROW = re.compile(r"^\s*((?:(?:[\d,]+|\.)(?:\s+\([^)]*\))?\s+)+)(\S.*)$")   # counts, then a name
_NUM = re.compile(r"([\d,]+|\.)(?:\s+\([^)]*\))?")


def read_dump(path: str) -> dict:
    """Totals and per-function self counts of one callgrind dump (via ``callgrind_annotate``)."""
    events, desc = None, ""
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("desc: Trigger:"):
                desc = line.split("Trigger:", 1)[1].replace("Client Request:", "").strip()
    out = subprocess.run(["callgrind_annotate", "--inclusive=no", "--auto=no", "--threshold=100", "--show=" + ",".join(events),
                          "--sort=Ir", path], check=True, capture_output=True, text=True).stdout
    totals, funcs, in_funcs = {}, {}, False
    for line in out.splitlines():
        m = _ROW.match(line)
        if not m:
            in_funcs = in_funcs or "file:function" in line
            continue
        nums = [0 if t == "." else int(t.replace(",", "")) for t in _NUM.findall(m.group(1))]
        counts = dict(zip(events, nums))
        if m.group(2).strip() == "PROGRAM TOTALS":
            totals = counts
        elif in_funcs:
            funcs[m.group(2).strip()] = counts
    return {"trigger": desc, "events": events, "totals": totals, "funcs": funcs}


_KERNEL_SRC = re.compile(r"^(cpp_fused\w*) = async_compile\.cpp_pybinding\(\[.*?\], r\'\'\'\n(.*?)\'\'\'\)",
                         re.S | re.M)


class KernelNames:
    """Inductor's C++ kernels are all called ``kernel``, one per .so; their names
    (``cpp_fused_...``) are in the output code that loaded them: matched by source text."""

    def __init__(self, output_code_files: list[str]):
        self.sources = []
        for path in output_code_files:
            try:
                text = open(path).read()
            except OSError:
                continue
            self.sources += [(name, src.strip()) for name, src in _KERNEL_SRC.findall(text)]
        self.memo: dict = {}

    def name(self, so_path: str) -> str | None:
        if so_path not in self.memo:
            found = None
            stem = so_path[:-len(".so")] if so_path.endswith(".so") else so_path
            for cpp in (stem + ".cpp", stem + ".main.cpp"):
                if os.path.exists(cpp):
                    text = open(cpp, errors="replace").read()
                    found = next((n for n, src in self.sources if src and src in text), None)
                    break
            self.memo[so_path] = found
        return self.memo[so_path]


def split_name(name: str) -> tuple[str, str]:
    """``file:function [object]`` -> (function, object)."""
    m = re.match(r"^(.*?)(?:\s+\[(.*)\])?$", name)
    fn, obj = m.group(1), m.group(2) or ""
    fn = fn.split(":", 1)[1] if ":" in fn and not fn.startswith("0x") else fn
    return fn, obj


def category(obj: str) -> str:
    """Where a function lives: inductor's kernels, MKL, oneDNN, ATen, libc/libm, Python, other."""
    base = os.path.basename(obj)
    if "torchinductor" in obj:
        return "inductor kernels"
    for key, cat in (("libmkl", "MKL"), ("libiomp", "OpenMP"), ("libgomp", "OpenMP"), ("dnnl", "oneDNN"),
                     ("libtorch_cpu", "ATen (libtorch_cpu)"), ("libtorch_python", "torch Python bindings"),
                     ("libc10", "c10"), ("libc.so", "libc"), ("libc-", "libc"), ("libm.so", "libm"),
                     ("libm-", "libm"), ("python", "Python"), ("libstdc++", "libstdc++"), ("ld-linux", "ld.so")):
        if key in base:
            return cat
    return base or "unknown"


def kernel_group(name: str, names: KernelNames | None = None) -> str:
    """A function's name without its file; an inductor kernel by its ``cpp_fused_...`` name."""
    fn, obj = split_name(name)
    if "torchinductor" in obj and names is not None:
        fn = names.name(obj) or f"{fn} [{os.path.basename(obj)}]"
    return fn


def summarise(dumps: list[dict], top: int, names: KernelNames | None = None) -> dict:
    """Per side: the totals of every repeat, and per function and per library the self Ir of
    the first repeat; the functions where the sides differ most."""
    by_side = defaultdict(list)
    for d in dumps:
        side = d["trigger"].split("-")[0]
        by_side[side].append(d)
    result = {"totals": {s: [d["totals"] for d in ds] for s, ds in by_side.items()}}
    per, cats = {}, {}
    for side, ds in by_side.items():
        acc, cat = defaultdict(int), defaultdict(int)
        for name, c in ds[0]["funcs"].items():
            acc[kernel_group(name, names)] += c.get("Ir", 0)
            cat[category(split_name(name)[1])] += c.get("Ir", 0)
        per[side], cats[side] = acc, cat
    result["categories"] = {s: dict(sorted(c.items(), key=lambda kv: -kv[1])) for s, c in cats.items()}
    f, p = per.get("functional", {}), per.get("plain", {})
    names = set(f) | set(p)
    rows = sorted(((f.get(n, 0) - p.get(n, 0), n, f.get(n, 0), p.get(n, 0)) for n in names), reverse=True)
    kernels = {s: sorted(((c, n) for n, c in acc.items() if n.startswith("cpp_fused")), reverse=True)
               for s, acc in per.items()}
    result["excess"] = [dict(name=n, functional=a, plain=b, diff=d) for d, n, a, b in rows[:top]]
    result["deficit"] = [dict(name=n, functional=a, plain=b, diff=d) for d, n, a, b in rows[::-1][:top]]
    result["kernels"] = {s: [dict(name=n, Ir=c) for c, n in ks[:top]] for s, ks in kernels.items()}
    result["kernel_totals"] = {s: sum(c for c, _ in ks) for s, ks in kernels.items()}
    return result


def print_summary(s: dict) -> None:
    print("\nper-step totals (each repeat; Ir = instructions executed):")
    for side, ts in s["totals"].items():
        for i, t in enumerate(ts):
            print(f"  {side:10s} #{i}: " + "  ".join(f"{e} {v:,}" for e, v in t.items()))
    tf, tp = s["totals"].get("functional"), s["totals"].get("plain")
    if tf and tp:
        for e in tf[0]:
            print(f"  ratio functional/plain {e}: " + ", ".join(f"{a[e] / b[e]:.4f}" for a, b in zip(tf, tp)))
    print("\nper library (Ir, first repeat):")
    cf, cp = s["categories"].get("functional", {}), s["categories"].get("plain", {})
    print(f"  {'functional':>14s} {'plain':>14s} {'diff':>14s}  library")
    for c in sorted(set(cf) | set(cp), key=lambda c: -(cf.get(c, 0) + cp.get(c, 0)))[:15]:
        a, b = cf.get(c, 0), cp.get(c, 0)
        print(f"  {a:14,} {b:14,} {a - b:14,}  {c}")
    for title, key in (("functions where ours executes MORE (Ir, ours - plain)", "excess"),
                       ("functions where ours executes LESS", "deficit")):
        print(f"\n{title}:")
        print(f"  {'diff':>14s} {'functional':>14s} {'plain':>14s}  function")
        for r in s[key]:
            print(f"  {r['diff']:14,} {r['functional']:14,} {r['plain']:14,}  {r['name'][:110]}")
    for side, ks in s["kernels"].items():
        print(f"\n{side}: inductor kernels by Ir")
        for k in ks:
            print(f"  {k['Ir']:14,}  {k['name'][:110]}")


def annotate(directory: str, top: int, json_path: str | None) -> None:
    files = sorted((f for f in os.listdir(directory) if re.match(r"callgrind\.out\.\d+$", f)),
                   key=lambda f: int(f.rsplit(".", 1)[1]))
    dumps = [read_dump(os.path.join(directory, f)) for f in files]
    dumps = [d for d in dumps if d["trigger"].split("-")[0] in ("functional", "plain")]
    if not dumps:
        raise SystemExit(f"no step dumps (callgrind.out.N with a functional-/plain- trigger) in {directory}")
    listing = os.path.join(directory, "output_code.json")
    names = KernelNames(json.load(open(listing))) if os.path.exists(listing) else None
    s = summarise(dumps, top, names)
    print_summary(s)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(s, f, indent=1)
        print(f"wrote {json_path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="benchmarks/single_device.py preset (tiny, small)")
    ap.add_argument("--batch", type=int, default=None, help="override the preset's batch size")
    ap.add_argument("--seq", type=int, default=None, help="override the preset's sequence length")
    ap.add_argument("--warmup", type=int, default=2, help="uninstrumented steps per side before counting (>= 1)")
    ap.add_argument("--repeats", type=int, default=2, help="counted steps per side (alternating who goes first)")
    ap.add_argument("--cache-sim", action="store_true", help="also simulate caches (D1/LL misses; slower)")
    ap.add_argument("--top", type=int, default=25, help="functions to list")
    ap.add_argument("--out", default=None, help="directory for the callgrind dumps (default: a temporary one)")
    ap.add_argument("--annotate", default=None, metavar="DIR", help="only summarise the dumps in DIR")
    ap.add_argument("--json", default=None, help="write the summary to this file")
    ap.add_argument("--capture", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shim", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step compiles)")
    if args.capture or args.replay:
        sys.path.insert(0, HERE)
        return capture(args) if args.capture else replay(args)
    if args.annotate:
        return annotate(args.annotate, args.top, args.json)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind")
    out = args.out or tempfile.mkdtemp(prefix="instr_count_")
    os.makedirs(out, exist_ok=True)
    shim = build_shim(out)
    me = [sys.executable, os.path.abspath(__file__), "--out", out, "--preset", args.preset,
          "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    if args.batch:
        me += ["--batch", str(args.batch)]
    if args.seq:
        me += ["--seq", str(args.seq)]
    env = dict(os.environ, **AVX2_ENV)
    print("compiling and capturing one step of each side natively: " + " ".join(me + ["--capture"]), flush=True)
    subprocess.run(me + ["--capture"], check=True, env=env)
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/callgrind.out",
           f"--cache-sim={'yes' if args.cache_sim else 'no'}", "--error-limit=no"] + me + ["--replay", "--shim", shim]
    print("running: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    print(f"dumps in {out}")
    annotate(out, args.top, args.json)


if __name__ == "__main__":
    main()
