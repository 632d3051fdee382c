"""One-GPU benchmark: measured bf16 matmul peak, then a Llama-3-1B-shaped model trained in bf16
through ``fpp.train_step``, eager and compiled, against the plain ``nn.Module`` of
``benchmarks/single_device.py`` with ``torch.compile`` and fused ``torch.optim.AdamW``.

    python benchmarks/gpu.py                     # CUDA device 0; meant to take under 8 minutes
                                                 # on one H100/H200 (never run on a GPU yet)
    python benchmarks/gpu.py --layers 16         # the full 16 layers (longer compile)
    python benchmarks/gpu.py --smoke             # a tiny version on CPU (tested in the suite)

Before timing, the first steps' losses of the functional step on the GPU (bf16, eager) must
equal those of the same steps in fp32 on the CPU within 2e-2 (``reference``; a small batch of
its own). Prints one JSON line: the measured peak TFLOP/s and the GPU's bf16 peak by name
(``spec_peak_tflops``, the table in ``functional_pp/app/world.py``; null when unknown), and for
each side (``functional_eager``, ``functional`` compiled, ``plain`` compiled) tokens/s, MFU
against the measured peak and ``mfu_of_spec_peak`` (training FLOPs per token from
``llama.flops_per_token``, attention included), peak memory (``torch.cuda.max_memory_allocated`` over one step; null on CPU), the median step
time, the compile (first-step) time and the first losses; then functional / plain ratios.

Both sides start from the same weights and the same batch; the first-step losses must agree
within 2e-2 relative (bf16) before anything is timed. The model is Llama 3.2 1B's shape
(hidden 2048, 32 heads / 8 KV heads of 64, MLP 8192, vocab 128256) with fewer layers (4 by
default, so that both compilations and the timing fit in eight minutes), untied embeddings
and no rope scaling (the plain module has neither; neither changes the step's cost).
"""
from __future__ import annotations

import argparse
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


# --------------------------------------------------------------------------- the two sides
class Functional:
    """``fpp.train_step``: bf16 compute over fp32 master weights (``precision``), the whole step
    compiled with ``backend`` (None: eager)."""

    def __init__(self, cfg, params, backend, device, precision="bf16"):
        opt = fpp.optim.adamw(OPT["lr"], b1=OPT["b1"], b2=OPT["b2"], eps=OPT["eps"],
                              weight_decay=OPT["weight_decay"])
        compile_ = False if backend is None else True if backend == "inductor" else backend
        self.step_fn = fpp.train_step(functools.partial(llama.loss, cfg=cfg), opt, precision=precision,
                                      compile=compile_)
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


def measure(runner, batch, warmup: int, steps: int, device: str) -> dict:
    """First (compiling) step time, median step time of ``steps`` after ``warmup``, losses,
    and the peak memory of one more step (CUDA only)."""
    t0 = time.perf_counter()
    losses = [runner.step(batch)]
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        losses.append(runner.step(batch))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(runner.step(batch))
        times.append(time.perf_counter() - t0)
    peak = None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        losses.append(runner.step(batch))
        peak = int(torch.cuda.max_memory_allocated())
    return {"first_step_s": first, "median_step_s": statistics.median(times), "losses": losses[:3],
            "peak_memory_bytes": peak}


# --------------------------------------------------------------------------- driver
def model_config(args) -> llama.Config:
    if args.smoke:
        return llama.Config(vocab=256, hidden=64, layers=args.layers, heads=4, kv_heads=2, mlp=128,
                            rope_theta=10000.0, rope_scaling=None, norm_eps=1e-5, max_seq=max(args.seq, 512))
    return llama.Config.llama3_1b(layers=args.layers, tie_embeddings=False, rope_scaling=None,
                                  max_seq=max(args.seq, 512))


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


def run(args) -> dict:
    device = args.device
    peak = matmul_peak_tflops(args.matmul_size, device, args.matmul_iters)
    spec = peak_flops(torch.device(device))          # the GPU's bf16 peak by name (None: unknown / CPU)
    cfg = model_config(args)
    batch = make_batch(cfg, args.batch, args.seq, device)
    tokens = args.batch * args.seq
    flops = llama.flops_per_token(cfg, args.seq)
    out = {"benchmark": "gpu" if not args.smoke else "gpu --smoke (CPU)", "device": _device_name(device),
           "torch": torch.__version__, "matmul_peak_tflops": peak, "matmul_size": args.matmul_size,
           "model": {"hidden": cfg.hidden, "layers": cfg.layers, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                     "mlp": cfg.mlp, "vocab": cfg.vocab, "params": fpp.count_params(llama.init(cfg))},
           "batch": args.batch, "seq": args.seq, "tokens_per_step": tokens, "flops_per_token": flops,
           "compile_backend": args.compile_backend,
           "spec_peak_tflops": None if spec is None else spec / 1e12}
    out["reference"] = reference_check(cfg, args)
    makers = {"functional_eager": lambda prm: Functional(cfg, prm, None, device),
              "functional": lambda prm: Functional(cfg, prm, args.compile_backend, device),
              "plain": lambda prm: Plain(cfg, prm, args.compile_backend, device, args.seq)}
    for name, make in makers.items():
        # one side at a time, each from freshly initialised (identical) weights, so that its
        # peak memory holds nothing of the other side's
        runner = make(fpp.init(llama.init, cfg, seed=0, device=device))
        r = measure(runner, batch, args.warmup, args.steps, device)
        r["tokens_per_s"] = tokens / r["median_step_s"]
        r["mfu"] = r["tokens_per_s"] * flops / (peak * 1e12)
        r["mfu_of_spec_peak"] = None if spec is None else r["tokens_per_s"] * flops / spec
        out[name] = r
        del runner
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    f, p = out["functional"], out["plain"]
    rel = abs(f["losses"][0] - p["losses"][0]) / abs(p["losses"][0])
    if rel > 2e-2:
        raise AssertionError(f"first-step losses differ: functional {f['losses'][0]} vs plain "
                             f"{p['losses'][0]} (relative {rel:.3g} > 2e-2): not the same model")
    out["first_loss_rel_diff"] = rel
    out["tokens_per_s_ratio"] = f["tokens_per_s"] / p["tokens_per_s"]
    out["eager_tokens_per_s_ratio"] = out["functional_eager"]["tokens_per_s"] / p["tokens_per_s"]
    out["peak_memory_ratio"] = (f["peak_memory_bytes"] / p["peak_memory_bytes"]
                                if f["peak_memory_bytes"] and p["peak_memory_bytes"] else None)
    return out


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({os.cpu_count()} cores)"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model on CPU, aot_eager, 2 steps: checks the script runs (numbers meaningless)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the 1B shape (default 4; smoke 2)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; smoke 32)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per side (default 10; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps incl. the compiling one (default 3)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; smoke aot_eager)")
    ap.add_argument("--matmul-size", type=int, default=None, help="matmul side for the peak (default 8192)")
    args = ap.parse_args(argv)
    defaults = (dict(layers=2, batch=2, seq=32, steps=2, warmup=1, compile_backend="aot_eager", matmul_size=128)
                if args.smoke else
                dict(layers=4, batch=4, seq=2048, steps=10, warmup=3, compile_backend="inductor", matmul_size=8192))
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
