"""A rollout's sampling (functional_pp/preference/rollout.py ``sample_completions``): one
``generate`` call per prompt length (the rollout before, rebuilt here: rows grouped by prompt
length, shortest first) against one left-padded call for every row (what runs now).

    python benchmarks/rollout_batching.py                   # 32 prompts of lengths 8, 11, ..., 101
    python benchmarks/rollout_batching.py --prompts 64 --generations 8 --new 64

For ``--prompts`` random prompts of distinct lengths (``--min-length`` + ``--step`` x i), each
sampled ``--generations`` times for ``--new`` tokens (temperature 1, no stop token) on a small
random Llama, it prints each way's generate calls, its CPU time (median of ``--repeats``), the
positions its key / value caches hold (rows x (prompt + new), summed over the calls: the left
padding's cost) and the ratio of the times. First, greedily, the two ways' completions are
checked equal (each row's tokens do not depend on its batch)."""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.models.sampling import generate
from functional_pp.preference import rollout
from functional_pp.preference.rollout import generation_seed, sample_completions


def per_length(forward, params, prompts: list[list[int]], *, generations: int, new: int, temperature: float,
               key: int = 0, step: int = 0) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The rollout before: one generate call per prompt length (its rows unpadded, one seed per
    call); the completions in row order and each call's ``(rows, prompt length)``."""
    rows = [p for p in prompts for _ in range(generations)]
    out: list[list[int]] = [[] for _ in rows]
    calls = []
    for part, length in enumerate(sorted({len(r) for r in rows})):
        which = [i for i, r in enumerate(rows) if len(r) == length]
        tokens = generate(forward, params, torch.tensor([rows[i] for i in which]), max_new_tokens=new,
                          temperature=temperature, seed=generation_seed(key, step, part))[:, length:]
        calls.append((len(which), length))
        for i, t in zip(which, tokens.tolist()):
            out[i] = t
    return out, calls


def one_call(forward, params, prompts: list[list[int]], *, generations: int, new: int, temperature: float,
             key: int = 0, step: int = 0) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The rollout now (``sample_completions``): its completions and each generate call's
    ``(rows, padded prompt length)``."""
    calls = []

    def counted(*args, **kw):
        calls.append(tuple(args[2].shape))
        return inner(*args, **kw)
    inner, rollout.generate = rollout.generate, counted
    try:
        out, _ = sample_completions(forward, params, prompts, num_generations=generations, max_completion_length=new,
                                    stop_ids=[], pad_id=0, temperature=temperature, key=key, step=step)
    finally:
        rollout.generate = inner
    return out, calls


def timed(fn, repeats: int) -> tuple[float, list, list]:
    """Median seconds of ``repeats`` runs of ``fn()``, and the last run's result."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out, calls = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-length", type=int, default=8)
    ap.add_argument("--step", type=int, default=3, help="the prompts' lengths: min-length + step x i")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--new", type=int, default=32, help="tokens sampled per row")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = llama.Config(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                       mlp=2 * args.hidden)
    with torch.no_grad():
        params = fpp.init(llama.init, cfg, torch.float32, seed=0)
    forward = functools.partial(llama.forward, cfg=cfg)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, args.vocab, (args.min_length + args.step * i,), generator=g).tolist()
               for i in range(args.prompts)]
    kw = dict(generations=args.generations, new=args.new)

    before, _ = per_length(forward, params, prompts, temperature=0.0, **kw)
    after, _ = one_call(forward, params, prompts, temperature=0.0, **kw)
    if before != after:
        raise SystemExit("the greedy completions of one call differ from the per-length calls'")
    print(f"greedy completions equal: one left-padded call vs per-length calls "
          f"({len(after)} rows of prompts {len(prompts[0])}..{len(prompts[-1])} tokens)")

    results = {}
    for name, fn in (("per length", per_length), ("one call", one_call)):
        with torch.no_grad():
            seconds, _, calls = timed(lambda: fn(forward, params, prompts, temperature=1.0, **kw), args.repeats)
        positions = sum(rows * (length + args.new) for rows, length in calls)
        results[name] = seconds
        print(f"{name:>10}: {len(calls):3d} generate calls, {seconds * 1e3:9.1f} ms CPU (median of "
              f"{args.repeats}), {positions} cached positions")
    print(f"ratio per length / one call: {results['per length'] / results['one call']:.2f}x "
          f"({args.prompts} prompts x {args.generations} generations, {args.new} new tokens, "
          f"{args.threads} thread{'s' if args.threads > 1 else ''})")


if __name__ == "__main__":
    main()
