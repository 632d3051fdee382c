"""One-GPU benchmark: ``fpp.train_step`` against plain PyTorch on Llama shapes, bf16.

    python benchmarks/gpu.py                     # both rows on CUDA device 0, under 8 minutes on an H200
    python benchmarks/gpu.py --models 1b         # one row
    python benchmarks/gpu.py --smoke             # a tiny version on CPU (tested in the suite)

Rows (``--models``): ``1b`` is Llama-3.2-1B (16 layers, tied embeddings, batch 4 x 2048);
``8b4`` the Llama-3.1-8B shape with 4 layers (untied, batch 2 x 4096). Rope scaling is off on
both sides (the plain module has none; it does not change the step's cost).

Sides: ``functional`` is the whole step compiled (``train_step(compile=True, precision="bf16")``,
fp32 master weights, AdamW, donated state; ``--functional-compile per_layer`` compiles each
layer instead, as the first H200 run had to on torch 2.11); ``functional_eager`` the same step uncompiled (1B
row only); ``plain`` the ``nn.Module`` of ``benchmarks/single_device.py`` with fp32
parameters, ``torch.autocast(bf16)``, ``torch.compile`` of forward + loss and
``torch.optim.AdamW(fused=True)``; with ``--loss-chunks N`` (or ``--loss-chunk-bytes N``),
``functional_chunked``: the compiled step with the LM head and loss over N token chunks
(``Config.loss_chunks``; or chunks of N bytes of fp32 logits, ``Config.loss_chunk_bytes``), the
memory lever issue 38 names for 128k vocabularies. Same weights, same batch; the first-step losses must agree
within 2e-2 (bf16) before anything is timed, and the functional step's first losses on the
device must equal the same steps in fp32 on the CPU within 2e-2 (``reference``).

Per side: the first (compiling) step's time, peak memory (the side's resident bytes plus
the rise of ``torch.cuda.max_memory_allocated`` over one step, so it holds nothing of the
other sides), then the timed steps, the sides' steps interleaved (machine noise hits all);
tokens/s, MFU against the measured bf16 matmul peak and the GPU's nominal peak by name
(``functional_pp/app/world.py``); a torch.profiler summary of one step (GPU kernels per step,
their total time, the top kernels; on CPU, aten ops). Prints one JSON line and, with
``--json FILE``, writes it after every row (a run stopped early keeps what it measured)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from single_device import OPT, PlainLlama, load_from_functional, make_batch, plain_loss  # noqa: E402

import functional_pp as fpp  # noqa: E402
from functional_pp.app.world import peak_flops  # noqa: E402
from functional_pp.models import llama  # noqa: E402


# --------------------------------------------------------------------------- matmul peak
def matmul_peak_tflops(n: int, device: str, iters: int) -> float:
    """Best-of-three bf16 ``n x n @ n x n`` throughput in TFLOP/s (2 n^3 FLOPs per product)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        _sync(device)
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12)
    return best


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- the sides
class Functional:
    """``fpp.train_step``: bf16 compute over fp32 master weights (``precision``), the whole step
    compiled with ``backend`` (None: eager), donated state."""

    def __init__(self, cfg, params, backend, device, precision="bf16", mode="step"):
        opt = fpp.optim.adamw(OPT["lr"], b1=OPT["b1"], b2=OPT["b2"], eps=OPT["eps"],
                              weight_decay=OPT["weight_decay"])
        compile_ = False if backend is None else True if backend == "inductor" else backend
        if compile_ and mode == "per_layer":       # each @fpp.layer compiled, the rest eager
            compile_ = "per_layer" if compile_ is True else f"per_layer:{backend}"
        self.step_fn = fpp.train_step(functools.partial(llama.loss, cfg=cfg), opt, precision=precision,
                                      compile=compile_, donate_state=True)
        self.state = self.step_fn.init(params)
        self.device = device

    def step(self, batch) -> float:
        self.state, m = self.step_fn(self.state, batch)
        _sync(self.device)
        return m["loss"]


class Plain:
    """The plain module: fp32 parameters, ``torch.autocast(bf16)``, ``torch.compile`` of
    forward + loss, fused AdamW (one kernel per step on CUDA; foreach on CPU)."""

    def __init__(self, cfg, params, backend, device, seq):
        self.model = PlainLlama(cfg, max_seq=seq).to(device)
        load_from_functional(self.model, params, cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=OPT["lr"], betas=(OPT["b1"], OPT["b2"]),
                                     eps=OPT["eps"], weight_decay=OPT["weight_decay"],
                                     fused=device == "cuda", foreach=device != "cuda")
        self.loss_fn = torch.compile(functools.partial(plain_loss, self.model), backend=backend)
        self.device = device

    def step(self, batch) -> float:
        with torch.autocast(self.device, dtype=torch.bfloat16):
            loss = self.loss_fn(batch["tokens"], batch["labels"])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = loss.item()
        _sync(self.device)
        return value


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def start_side(make, batch, warmup: int, device: str) -> tuple[object, dict]:
    """Build a side (from fresh weights), run its first (compiling) step and the other warm-up
    steps, then one step measuring its peak memory: the bytes it holds between steps plus
    the rise of the allocator's peak over the step (nothing of the other sides)."""
    before = _allocated(device)
    t0 = time.perf_counter()
    runner = make()
    losses = [runner.step(batch)]
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        losses.append(runner.step(batch))
    peak = None
    if device == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        losses.append(runner.step(batch))
        peak = int(torch.cuda.max_memory_allocated() - before)    # (the other sides' bytes are in `before`)
    return runner, {"first_step_s": first, "losses": losses[:3], "peak_memory_bytes": peak}


def kernel_profile(runner, batch, device: str, top: int = 8, gaps: int = 5) -> dict:
    """One step under torch.profiler: the GPU kernels (and copies) it launched, their summed
    time and the ``top`` kernels by time; on CPU the aten ops run (the CPU proxy). With them the
    step's timeline: its wall time, the time the device was busy (the union of the kernels'
    intervals), the idle rest, and the ``gaps`` longest idle stretches with the kernels on
    either side and the host ops running meanwhile (what the GPU waited for: a sync, the
    host's launching, a copy)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        runner.step(batch)
        wall = time.perf_counter() - t0
    every = list(prof.events())
    if device == "cuda":
        events = [e for e in every if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in every if e.name.startswith("aten::") and e.cpu_parent is None]
    by_name: dict = {}
    for e in events:
        n, t = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n + 1, t + e.time_range.elapsed_us())
    total = sum(t for _, t in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    counted = {id(e) for e in events}
    host = [e for e in every if e.device_type == DeviceType.CPU and id(e) not in counted]
    return {"kernels": len(events), "kernel_ms": total / 1e3, "wall_ms": wall * 1e3,
            **timeline(events, host, gaps),
            "top": [{"name": n[:90], "count": c, "ms": t / 1e3} for n, (c, t) in ranked]}


def timeline(events, host, gaps: int) -> dict:
    """The device's busy time (the union of ``events``' intervals), its span from the first
    start to the last end, and the ``gaps`` longest idle stretches inside that span: where
    (ms from the first start), how long, the events before and after, and the ``host`` events
    that overlap the stretch most (the innermost first among those covering it alike)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    if not spans:
        return {"busy_ms": 0.0, "span_ms": 0.0, "gaps": []}
    busy, holes = 0.0, []
    start, end, last = spans[0][0], spans[0][1], spans[0][2]
    for s, e, name in spans[1:]:
        if s > end:
            holes.append((s - end, end, s, last, name))
            busy += end - start
            start = s
        if e >= end:
            end, last = e, name
    busy += end - start
    out = []
    for length, a, b, before, after in sorted(holes, reverse=True)[:gaps]:
        overlap = sorted((-(min(b, h.time_range.end) - max(a, h.time_range.start)), h.time_range.elapsed_us(), h.name)
                         for h in host if h.time_range.start < b and h.time_range.end > a)
        names = list(dict.fromkeys(n[:60] for _, _, n in overlap))[:3]
        out.append({"at_ms": (a - spans[0][0]) / 1e3, "ms": length / 1e3, "previous": before[:60],
                    "next": after[:60], "host": names})
    return {"busy_ms": busy / 1e3, "span_ms": (end - spans[0][0]) / 1e3, "gaps": out}


def time_interleaved(runners: dict, batch, steps: int) -> dict:
    """``steps`` rounds, each one step of every side in turn: each side's median step time."""
    times: dict = {name: [] for name in runners}
    for _ in range(steps):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            runner.step(batch)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


# --------------------------------------------------------------------------- driver
ROWS = {"1b": dict(layers=16, tie=True, batch=4, seq=2048, eager=True),
        "8b4": dict(layers=4, tie=False, batch=2, seq=4096, eager=False)}


def model_config(name: str, args) -> llama.Config:
    row = ROWS[name]
    if args.smoke:
        return llama.Config(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, rope_theta=10000.0,
                            rope_scaling=None, norm_eps=1e-5, max_seq=512, tie_embeddings=row["tie"])
    make = llama.Config.llama3_1b if name == "1b" else llama.Config.llama3_8b
    return make(layers=args.layers or row["layers"], tie_embeddings=row["tie"], rope_scaling=None,
                max_seq=max(row["seq"], 512))


def reference_check(cfg, args) -> dict:
    """The first steps' losses on this device (bf16, eager) against the same steps in fp32 on
    the CPU, on a small batch of their own (the CPU reference must stay cheap): equal within
    bf16 tolerance (2e-2 relative), else this raises."""
    batch, seq, steps = args.ref_batch, args.ref_seq, args.ref_steps
    losses = {}
    for where, device, precision in (("cpu_fp32", "cpu", "fp32"), ("device_bf16", args.device, "bf16")):
        runner = Functional(cfg, fpp.init(llama.init, cfg, seed=0, device=device), None, device, precision)
        b = make_batch(cfg, batch, seq, device)
        losses[where] = [runner.step(b) for _ in range(steps)]
        del runner
        gc.collect()
    rel = max(abs(a - b) / abs(a) for a, b in zip(losses["cpu_fp32"], losses["device_bf16"]))
    if rel > 2e-2:
        raise AssertionError(f"the first {steps} losses on {args.device} in bf16 {losses['device_bf16']} differ from "
                             f"the CPU fp32 reference {losses['cpu_fp32']} (relative {rel:.3g} > 2e-2)")
    return {"batch": batch, "seq": seq, **{f"{k}_losses": v for k, v in losses.items()}, "max_rel_diff": rel}


def side_makers(cfg, args, seq: int, eager: bool) -> dict:
    """The row's sides, each a function building its runner: ``functional`` and ``plain``,
    ``functional_eager`` where the row has it, and with ``--loss-chunks N`` / ``--loss-chunk-bytes N``
    ``functional_chunked``: the functional step with the LM head and loss over N token chunks, or
    chunks of N bytes of fp32 logits (``Config.loss_chunks`` / ``loss_chunk_bytes``; same compile
    as ``functional``)."""
    device = args.device

    def functional(c, backend, mode="step"):
        return lambda: Functional(c, fpp.init(llama.init, c, seed=0, device=device), backend, device, mode=mode)
    # the sides whose first step is short and known first: a lease that runs out in the whole-step
    # compile keeps the plain side's and the eager step's numbers
    makers = {"plain": lambda: Plain(cfg, fpp.init(llama.init, cfg, seed=0, device=device), args.compile_backend,
                                     device, seq)}
    if eager:
        makers["functional_eager"] = functional(cfg, None)
    makers["functional"] = functional(cfg, args.compile_backend, args.functional_compile)
    if args.loss_chunks or args.loss_chunk_bytes:
        chunked = dataclasses.replace(cfg, loss_chunks=args.loss_chunks or None,
                                      loss_chunk_bytes=args.loss_chunk_bytes or None)
        makers["functional_chunked"] = functional(chunked, args.compile_backend, args.functional_compile)
    return makers


def run_row(name: str, args, peak: float, spec, out: dict | None = None, save=lambda: None) -> dict:
    """One row into ``out``: each side built, profiled and ``save()``d as it finishes (a run
    stopped by its time limit keeps the sides it measured), then the sides timed interleaved."""
    device, row = args.device, ROWS[name]
    out = {} if out is None else out
    cfg = model_config(name, args)
    bsz, seq = (2, 32) if args.smoke else (row["batch"], row["seq"])
    batch = make_batch(cfg, bsz, seq, device)
    tokens = bsz * seq
    flops = llama.flops_per_token(cfg, seq)
    out.update({"model": {"hidden": cfg.hidden, "layers": cfg.layers, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                          "mlp": cfg.mlp, "vocab": cfg.vocab, "tied": cfg.tie_embeddings,
                          "params": fpp.count_params(llama.init(cfg))},
                "batch": bsz, "seq": seq, "tokens_per_step": tokens, "flops_per_token": flops})
    makers = side_makers(cfg, args, seq, row["eager"])
    runners = {}
    for side, make in makers.items():
        print(f"gpu.py: {name} {side}: building and compiling", file=sys.stderr, flush=True)
        if not args.smoke:       # on the GPU a side that fails is reported and the others still run
            try:
                runners[side], out[side] = start_side(make, batch, args.warmup, device)
            except Exception as e:     # noqa: BLE001
                out[side] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
                print(f"gpu.py: {name} {side} FAILED: {out[side]['error']}", file=sys.stderr, flush=True)
                runners.pop(side, None)
                gc.collect()
                torch.cuda.empty_cache()
                save()
                continue
        else:
            runners[side], out[side] = start_side(make, batch, args.warmup, device)
        print(f"gpu.py: {name} {side}: first step {out[side]['first_step_s']:.1f} s, peak "
              f"{(out[side]['peak_memory_bytes'] or 0) / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        out[side]["profile"] = kernel_profile(runners[side], batch, device)
        gc.collect()
        save()
    if "functional" not in runners or "plain" not in runners:
        return out
    f, p = out["functional"], out["plain"]
    rel = abs(f["losses"][0] - p["losses"][0]) / abs(p["losses"][0])
    if rel > 2e-2:
        raise AssertionError(f"first-step losses differ: functional {f['losses'][0]} vs plain "
                             f"{p['losses'][0]} (relative {rel:.3g} > 2e-2): not the same model")
    out["first_loss_rel_diff"] = rel
    for side, median in time_interleaved(runners, batch, args.steps).items():
        r = out[side]
        r["median_step_s"] = median
        r["tokens_per_s"] = tokens / median
        r["mfu"] = r["tokens_per_s"] * flops / (peak * 1e12)
        r["mfu_of_spec_peak"] = None if spec is None else r["tokens_per_s"] * flops / spec
    del runners
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    out["tokens_per_s_ratio"] = f["tokens_per_s"] / p["tokens_per_s"]
    if "functional_eager" in out:
        out["eager_tokens_per_s_ratio"] = out["functional_eager"]["tokens_per_s"] / p["tokens_per_s"]
    if "tokens_per_s" in out.get("functional_chunked", {}):
        c = out["functional_chunked"]
        out["chunked_tokens_per_s_ratio"] = c["tokens_per_s"] / p["tokens_per_s"]
        out["chunked_peak_memory_ratio"] = (c["peak_memory_bytes"] / p["peak_memory_bytes"]
                                            if c["peak_memory_bytes"] and p["peak_memory_bytes"] else None)
    out["peak_memory_ratio"] = (f["peak_memory_bytes"] / p["peak_memory_bytes"]
                                if f["peak_memory_bytes"] and p["peak_memory_bytes"] else None)
    return out


def run(args) -> dict:
    device = args.device
    peak = matmul_peak_tflops(args.matmul_size, device, args.matmul_iters)
    spec = peak_flops(torch.device(device))          # the GPU's bf16 peak by name (None: unknown / CPU)
    out = {"benchmark": "gpu" if not args.smoke else "gpu --smoke (CPU)", "device": _device_name(device),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "matmul_peak_tflops": peak,
           "matmul_size": args.matmul_size, "compile_backend": args.compile_backend,
           "functional_compile": args.functional_compile,
           "spec_peak_tflops": None if spec is None else spec / 1e12, "rows": {}}
    # (two layers of the first row's model: the check is of the device's bf16 math, kept cheap)
    out["reference"] = reference_check(dataclasses.replace(model_config(args.models[0], args), layers=2), args)
    _save(out, args)
    for name in args.models:
        t0 = time.perf_counter()
        out["rows"][name] = {}
        run_row(name, args, peak, spec, out["rows"][name], lambda: _save(out, args))
        out["rows"][name]["row_seconds"] = time.perf_counter() - t0
        _save(out, args)
    return out


def _save(out: dict, args) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({os.cpu_count()} cores)"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny models on CPU, aot_eager, 2 steps: checks the script runs (numbers meaningless)")
    ap.add_argument("--models", default="1b,8b4", help="rows to run, of " + ", ".join(ROWS))
    ap.add_argument("--layers", type=int, default=None, help="override every row's layer count")
    ap.add_argument("--steps", type=int, default=None, help="timed rounds (default 10; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps incl. the compiling one (default 3)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; smoke aot_eager)")
    ap.add_argument("--functional-compile", choices=("step", "per_layer"), default="step",
                    help="the functional side's compile: the whole step (default) or each layer")
    ap.add_argument("--loss-chunks", type=int, default=0,
                    help="also time the functional step with the LM head and loss over this many token chunks "
                         "(side functional_chunked; default 0: not run)")
    ap.add_argument("--loss-chunk-bytes", type=int, default=0,
                    help="also time the functional step with the LM head and loss over token chunks of this many "
                         "bytes of fp32 logits (side functional_chunked; default 0: not run)")
    ap.add_argument("--matmul-size", type=int, default=None, help="matmul side for the peak (default 8192)")
    ap.add_argument("--json", default=None, help="also write the result to this file (after every row)")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in ROWS]
    if unknown or not args.models:
        ap.error(f"--models: unknown row {unknown[0] if unknown else '(none)'}; choose from {', '.join(ROWS)}")
    defaults = (dict(steps=2, warmup=1, compile_backend="aot_eager", matmul_size=128)
                if args.smoke else dict(steps=10, warmup=3, compile_backend="inductor", matmul_size=8192))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.matmul_iters = 2 if args.smoke else 50
    args.ref_batch, args.ref_seq, args.ref_steps = (1, 16, 2) if args.smoke else (1, 256, 2)
    args.device = "cpu" if args.smoke else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: this benchmark measures one GPU (use --smoke to try it on CPU)")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    if args.loss_chunk_bytes < 0 or args.loss_chunks < 0:
        ap.error("--loss-chunks and --loss-chunk-bytes must be >= 0 (0: no chunked side)")
    if args.loss_chunk_bytes and args.loss_chunks:
        ap.error("give --loss-chunks or --loss-chunk-bytes, not both")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    result = run(args)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
