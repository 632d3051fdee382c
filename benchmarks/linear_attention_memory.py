"""Peak memory of the gated delta rule's forward + backward (``ops.linear_attention.chunked_gated_delta_rule``),
the intra-chunk scores as today ("now": ops/decayed_scores.py, per channel by halving without a
chunk x chunk x head_dim tensor, either form recomputed in backward) beside the form they replaced
("before": ``cubic_scores``, the per-pair decay tensor as transformers' torch
``chunk_kimi_delta_attention``, kept by autograd), for a decay per key channel (Kimi Delta
Attention) and one per head (Gated DeltaNet), side by side in one run.

    python benchmarks/linear_attention_memory.py                 # heads 8, head_dim 128, seq 2048, batch 1, fp32
    python benchmarks/linear_attention_memory.py --smoke         # a small shape (seconds)

Measured on the CPU with torch's memory profiler (tests/memtrack.py): ``peak`` is the most memory
allocated at once during forward + backward beyond the inputs; ``saved`` what the forward leaves
allocated (the activations kept for backward, and the output). The last row compares, for the
per-head decay, its own branch ("now") with today's per-channel path given the decay repeated
over head_dim ("before"). Both forms give the same output and gradients (checked: the largest
difference is printed)."""
from __future__ import annotations

import argparse
import gc
import os
import sys
from contextlib import contextmanager

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from functional_pp.app.report import human_bytes  # noqa: E402
from functional_pp.ops import linear_attention  # noqa: E402
from memtrack import window_peaks  # noqa: E402


def cubic_scores(lefts: list[torch.Tensor], right: torch.Tensor, decay: torch.Tensor) -> list[torch.Tensor]:
    """The direct form of ``decayed_scores`` (the op's before the halving form), plain autograd: per
    channel, the pair decays exp(decay_i - decay_j) as a [..., C, C, D] tensor, as transformers' torch form."""
    C = right.shape[-2]
    upper = torch.ones(C, C, dtype=torch.bool, device=right.device).triu(1)
    if decay.dim() == right.dim() - 1:
        pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
        return [(left @ right.transpose(-1, -2)) * pair for left in lefts]
    pair = (decay.unsqueeze(-2) - decay.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()
    return [torch.einsum("...id,...jd,...ijd->...ij", left, right, pair) for left in lefts]


@contextmanager
def scores_form(form):
    """Run the op with ``form`` as its intra-chunk scores (``cubic_scores`` or today's)."""
    today = linear_attention.decayed_scores
    linear_attention.decayed_scores = form
    try:
        yield
    finally:
        linear_attention.decayed_scores = today


def inputs(batch: int, seq: int, heads: int, head_dim: int, per_channel: bool, seed: int = 0):
    """q, k, v, g, beta as Kimi's layer makes them: g = -exp(A_log) softplus(.) (A in [1, 16])."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, heads, head_dim, generator=gen) for _ in range(3))
    a = torch.empty(heads).uniform_(1, 16, generator=gen)
    raw = torch.randn(batch, seq, heads, *((head_dim,) if per_channel else ()), generator=gen)
    g = -torch.nn.functional.softplus(raw) * (a[:, None] if per_channel else a)
    beta = torch.rand(batch, seq, heads, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def measure(form, x, chunk: int) -> dict:
    """Forward + backward of the op under ``form``: peak and saved bytes, and the output."""
    gc.collect()
    with scores_form(form), window_peaks() as w:
        with w.window():
            out, _ = linear_attention.chunked_gated_delta_rule(*x, chunk=chunk)
        with w.window():
            out.sum().backward()
    grads = [t.grad for t in x]
    for t in x:
        t.grad = None
    return {"peak": max(w.peaks[0], w.retained[0] + w.peaks[1]), "saved": w.retained[0], "out": out.detach(), "grads": grads}


def run(args) -> list[dict]:
    rows = []
    for name, per_channel in (("Kimi Delta Attention (decay per key channel)", True),
                              ("Gated DeltaNet (decay per head)", False)):
        x = inputs(args.batch, args.seq, args.heads, args.head_dim, per_channel)
        old = measure(cubic_scores, x, args.chunk)
        new = measure(linear_attention.decayed_scores, x, args.chunk)
        diff = max((a - b).abs().max().item() for a, b in zip([old["out"]] + old["grads"], [new["out"]] + new["grads"]))
        rows.append({"rule": name, "old_peak": old["peak"], "new_peak": new["peak"], "old_saved": old["saved"],
                     "new_saved": new["saved"], "max_diff": diff})
    # the per-head decay through the per-channel path (repeated over head_dim): what keeping its own branch saves
    x = inputs(args.batch, args.seq, args.heads, args.head_dim, False)
    direct = measure(linear_attention.decayed_scores, x, args.chunk)
    wide = [t.detach().requires_grad_() for t in x]
    wide[3] = x[3].detach()[..., None].expand(*x[3].shape, args.head_dim).requires_grad_()
    halving = measure(linear_attention.decayed_scores, wide, args.chunk)
    diff = max((a - b).abs().max().item() for a, b in zip([direct["out"]] + direct["grads"][:3],
                                                          [halving["out"]] + halving["grads"][:3]))
    rows.append({"rule": "Gated DeltaNet: its per-head branch vs the per-channel one (decay repeated)",
                 "old_peak": halving["peak"], "new_peak": direct["peak"], "old_saved": halving["saved"],
                 "new_saved": direct["saved"], "max_diff": diff})
    return rows


def table(rows: list[dict], args) -> str:
    head = (f"batch {args.batch}, seq {args.seq}, heads {args.heads}, head_dim {args.head_dim}, chunk {args.chunk}, "
            "fp32, CPU, forward + backward\n\n"
            "| rule | peak, before | peak, now | ratio | saved, before | saved, now | ratio | "
            "max difference |\n|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['rule']} | {human_bytes(r['old_peak'])} | {human_bytes(r['new_peak'])} | "
        f"{r['old_peak'] / r['new_peak']:.1f}x | {human_bytes(r['old_saved'])} | {human_bytes(r['new_saved'])} | "
        f"{r['old_saved'] / r['new_saved']:.1f}x | {r['max_diff']:.1e} |" for r in rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="seq 128, heads 2, head_dim 32")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq, args.heads, args.head_dim = 128, 2, 32
    return args


if __name__ == "__main__":
    a = parse_args()
    torch.set_num_threads(a.threads)
    print(table(run(a), a))
