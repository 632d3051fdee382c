"""Forward + backward of Mamba (v1)'s selective scan (``models.mamba1.selective_scan``), the chunked
scan of today ("chunked": ``ops.linear_scan``) beside the loop position by position it replaced
("loop"), at a few sequence lengths of a tiny mixer, side by side in one run.

    python benchmarks/mamba1_scan.py                        # batch 1, 64 channels, state 16, seq 512 1024 2048
    python benchmarks/mamba1_scan.py --smoke                # a small shape (seconds)
    python benchmarks/mamba1_scan.py --inner 1024 --seq 512 # the shape docs/models.md compared with transformers

Timing: the median wall time of ``--repeats`` forward + backward runs of each form, interleaved (one
of each in turn), after a warm-up, on ``--threads`` CPU threads (default 1). Memory: the peak
allocated during one forward + backward beyond the inputs and what the forward leaves for backward
(torch's memory profiler, tests/memtrack.py). Both forms give the same output and gradients
(checked in float64 on the first length: the largest difference is printed)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import functional_pp as fpp  # noqa: E402
from functional_pp.app.report import human_bytes  # noqa: E402
from functional_pp.models import mamba1  # noqa: E402
from memtrack import window_peaks  # noqa: E402


def loop_scan(a: torch.Tensor, u: torch.Tensor, dim: int, start: torch.Tensor | None = None) -> torch.Tensor:
    """The scan before: position by position along ``dim``, every state stacked (transformers'
    reference loop, ``mamba_selective_scan``)."""
    h = u.select(dim, 0) if start is None else a.select(dim, 0) * start + u.select(dim, 0)
    out = [h]
    for t in range(1, u.shape[dim]):
        h = a.select(dim, t) * h + u.select(dim, t)
        out.append(h)
    return torch.stack(out, dim)


@contextmanager
def scan_form(form):
    """Run the mixer's scan with ``form`` (``loop_scan`` or today's)."""
    today = mamba1.linear_scan
    mamba1.linear_scan = form
    try:
        yield
    finally:
        mamba1.linear_scan = today


def inputs(batch: int, seq: int, inner: int, state: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """x, dt, B, C, A_log, D, dt_bias as the mixer hands them to the scan (A_log = log(1..N), S4D-real)."""
    g = torch.Generator().manual_seed(seed)
    x, dt = (torch.randn(batch, seq, inner, generator=g, dtype=dtype) for _ in range(2))
    b, c = (torch.randn(batch, seq, state, generator=g, dtype=dtype) for _ in range(2))
    a_log = torch.arange(1, state + 1, dtype=dtype).log().expand(inner, state).contiguous()
    d, bias = torch.randn(inner, generator=g, dtype=dtype), torch.full((inner,), -4.0, dtype=dtype)
    return [t.requires_grad_() for t in (x, dt, b, c, a_log, d, bias)]


DIMS = ("batch seq mamba_inner", "batch seq mamba_inner", "batch seq ssm_state", "batch seq ssm_state",
        "mamba_inner ssm_state", "mamba_inner", "mamba_inner")


def forward(ts: list[torch.Tensor]) -> torch.Tensor:
    return mamba1.selective_scan(*(fpp.wrap(t, d) for t, d in zip(ts, DIMS))).value()


def step(ts: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for t in ts:
        t.grad = None
    y = forward(ts)
    y.backward(torch.ones_like(y))
    return y.detach(), [t.grad for t in ts]


def agreement(batch: int, seq: int, inner: int, state: int) -> float:
    """The largest difference of output and gradients between the two forms, float64."""
    ts = inputs(batch, seq, inner, state, torch.float64)
    with scan_form(loop_scan):
        y0, g0 = step(ts)
    y1, g1 = step(ts)
    return max((a - b).abs().max().item() for a, b in zip([y0] + g0, [y1] + g1))


def measure(args) -> list[dict]:
    rows = []
    forms = {"loop": loop_scan, "chunked": mamba1.linear_scan}
    for seq in args.seq:
        ts = inputs(args.batch, seq, args.inner, args.state, torch.float32)
        times = {k: [] for k in forms}
        for _ in range(args.warmup):
            for form in forms.values():
                with scan_form(form):
                    step(ts)
        for _ in range(args.repeats):
            for name, form in forms.items():
                with scan_form(form):
                    t0 = time.perf_counter()
                    step(ts)
                    times[name].append(time.perf_counter() - t0)
        memory = {}
        with window_peaks() as w:
            for name, form in forms.items():
                with scan_form(form):
                    with w.window():
                        y = forward(ts)
                    with w.window():
                        y.backward(torch.ones_like(y))
                    del y
        for i, name in enumerate(forms):
            memory[name] = (max(w.peaks[2 * i], w.retained[2 * i] + w.peaks[2 * i + 1]), w.retained[2 * i])
        row = {"seq": seq, **{f"{k}_s": statistics.median(v) for k, v in times.items()}, "memory": memory}
        row["speedup"] = row["loop_s"] / row["chunked_s"]
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--inner", type=int, default=64)
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="a small shape, one repeat")
    args = p.parse_args(argv)
    if args.smoke:
        args.inner, args.state, args.seq, args.repeats, args.warmup = 8, 4, [40], 1, 0
    torch.set_num_threads(args.threads)
    diff = agreement(args.batch, min(args.seq), args.inner, args.state)
    print(f"mamba1 selective scan, forward + backward: batch {args.batch}, {args.inner} channels, state "
          f"{args.state}, fp32, {args.threads} thread(s); the two forms agree to {diff:.1e} (fp64)")
    print(f"{'seq':>6} {'loop s':>9} {'chunked s':>10} {'speedup':>8}  {'peak loop':>10} {'peak chunked':>13}"
          f"  {'saved loop':>10} {'saved chunked':>13}")
    rows = measure(args)
    for r in rows:
        (pl, sl), (pc, sc) = r["memory"]["loop"], r["memory"]["chunked"]
        print(f"{r['seq']:>6} {r['loop_s']:>9.4f} {r['chunked_s']:>10.4f} {r['speedup']:>7.1f}x  "
              f"{human_bytes(pl):>10} {human_bytes(pc):>13}  {human_bytes(sl):>10} {human_bytes(sc):>13}")
    return {"agreement": diff, "rows": rows}


if __name__ == "__main__":
    main()
