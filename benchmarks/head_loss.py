"""The LM head + cross-entropy alone, forward and backward: plain torch (``x @ w`` then
``F.cross_entropy``), ours unchunked (``ops.cross_entropy(ops.einsum(...))``) and ours over
token chunks (``ops.linear_cross_entropy``, docs/compile.md "The LM head and cross-entropy over
token chunks").

    python benchmarks/head_loss.py                                   # inductor, preset small's head
    python benchmarks/head_loss.py --mode eager --chunk-mib 4 16
    python benchmarks/head_loss.py --threads 1 --repeats 8

The variants run interleaved (A, B, C, A, B, C, ...); each prints the median wall and process
CPU time per forward+backward, and the peak of torch CPU-allocator bytes during one call
(profiler memory events, as ``single_device.py``). The losses and gradients are checked against
plain torch before timing.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

import functional_pp as fpp
from functional_pp import ops


def plain(x, w, labels):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = F.cross_entropy((x @ w).float(), labels)
    return (loss.detach(), *torch.autograd.grad(loss, (x, w)))


def ours(x, w, labels, chunk_bytes):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = ops.linear_cross_entropy(fpp.wrap(x, "tok hidden"), fpp.wrap(w, "hidden vocab"),
                                    fpp.wrap(labels, "tok"), chunk_bytes=chunk_bytes).data
    return (loss.detach(), *torch.autograd.grad(loss, (x, w)))


def peak_bytes(fn, *args) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    cur = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[4, 16], help="chunk sizes (MiB of fp32 logits)")
    ap.add_argument("--mode", default="inductor", help="eager, or a torch.compile backend")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=6, help="interleaved rounds (3 calls each) per variant")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.automatic_dynamic_shapes = False      # each variant its own static graph
    torch._dynamo.config.cache_size_limit = 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g) * 0.5
    w = torch.randn(args.hidden, args.vocab, generator=g) * 0.02
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    fns = {"plain": plain, "ours unchunked": functools.partial(ours, chunk_bytes=0)}
    for mib in args.chunk_mib:
        fns[f"ours chunk {mib:g} MiB"] = functools.partial(ours, chunk_bytes=int(mib * 2 ** 20))
    if args.mode != "eager":
        fns = {k: torch.compile(f, backend=args.mode) for k, f in fns.items()}
    print(f"head + loss: {args.tokens} tokens x hidden {args.hidden} x vocab {args.vocab}, {args.mode}, "
          f"{torch.get_num_threads()} threads")
    ref = None
    for name, fn in fns.items():
        t = time.perf_counter()
        out = fn(x, w, labels)
        ref = out if ref is None else ref
        err = max(float((a - b).abs().max()) for a, b in zip(out, ref))
        print(f"  {name:22s} first call {time.perf_counter() - t:6.1f} s   max diff to plain {err:.1e}")
        assert err < 1e-4, f"{name} differs from plain torch by {err}"
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            for _ in range(3):
                fn(x, w, labels)
            wall[name].append((time.perf_counter() - t) / 3 * 1e3)
            cpu[name].append((time.process_time() - c) / 3 * 1e3)
    base = statistics.median(cpu["plain"])
    print(f"  {'variant':22s} {'wall ms':>8s} {'cpu ms':>8s} {'cpu/plain':>9s} {'peak MiB':>9s}")
    for name, fn in fns.items():
        c = statistics.median(cpu[name])
        print(f"  {name:22s} {statistics.median(wall[name]):8.1f} {c:8.1f} {c / base:9.3f} "
              f"{peak_bytes(fn, x, w, labels) / 2 ** 20:9.1f}")


if __name__ == "__main__":
    main()
