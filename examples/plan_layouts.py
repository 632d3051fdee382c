"""Rank the layouts of Llama 3 8B (32 layers: 1 and 2 are run, the rest extrapolated exactly)
on 8 H100s without running it: one representative device on meta tensors per layout, a time
model of the node, the Pareto front of (step time, memory). Runs in well under a minute."""
import functools
import sys

import torch

from functional_pp import plan
from functional_pp.models import llama

cfg = llama.Config.llama3_8b()
batch = {"tokens": ((8, 4096), "batch seq"), "labels": ((8, 4096), "batch seq")}
space = plan.Space(remat=(False,), keep_gathered=(False,), cp_attention=("ring",), sequence_parallel=(True,))


def progress(i, n, name):
    print(f"\r  {i + 1}/{n} {name[:60]:<60}", end="", file=sys.stderr, flush=True)


ranked = plan.search(functools.partial(llama.loss, cfg=cfg), llama.init(cfg, torch.bfloat16), 8, batch,
                     cluster="h100x8", space=space, progress=progress)
print(file=sys.stderr)
print(ranked.table(10))
best = ranked[0]
print(f"\nbest: {best.describe()}: peak memory by category (GB):",
      {k: round(v / 1e9, 2) for k, v in best.memory.items()})
print("seconds per collective:", {k: round(v, 4) for k, v in best.time.by_collective.items()})
print("Pareto front:", [e.describe() for e in ranked.pareto()])
