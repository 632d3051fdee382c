"""One eager training step of a tiny model with the per-step metrics read against the deferred
read (``train_step(metrics="deferred")``, read once every ``--read-every`` steps, as the CLI
loop does every ``log_every`` steps; docs/eager_overhead.md "Host synchronisation").

    python benchmarks/host_sync.py --steps 200 --read-every 10

Both modes run the same model from the same weights in one process, in interleaved blocks of
``--read-every`` steps (per-step block, deferred block, ...), with and without donated state
(``--donate both|on|off``), and the losses are checked to be equal. Reported: the median
process CPU time per step of each mode and their ratio. On the CPU a device read costs
little (the values are already in memory), so the gain is small there; what the deferred mode
removes is the wait on an accelerator (the host keeps enqueuing steps).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import functional_pp as fpp  # noqa: E402
from functional_pp.models import llama  # noqa: E402

MODEL = dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128)   # as benchmarks/eager_overhead.py


def _batch(cfg: llama.Config, seq: int, seed: int) -> dict:
    ids = torch.randint(0, cfg.vocab, (2, seq + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def run(steps: int, read_every: int, donate: bool, seq: int = 64) -> dict:
    """Median CPU seconds per step of each mode (``steps`` each, interleaved blocks)."""
    cfg = llama.Config(**MODEL, max_seq=seq, tie_embeddings=False, rope_scaling=None)
    sides = {}
    for mode in ("per_step", "deferred"):
        step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-3, weight_decay=0.1),
                              metrics=mode, donate_state=donate)
        sides[mode] = {"step": step, "state": step.init(fpp.init(llama.init, cfg, seed=0)), "cpu": [], "losses": []}
    batches = [_batch(cfg, seq, i) for i in range(read_every)]
    for side in sides.values():                  # warm-up: plans and memos built
        side["state"], m = side["step"](side["state"], batches[0])
        side["step"].read()
        side["losses"].append(m["loss"])
    for _ in range(max(steps // read_every, 1)):
        for side in sides.values():
            metrics = []
            c0 = time.process_time()
            for b in batches:
                side["state"], m = side["step"](side["state"], b)
                metrics.append(m)
            side["step"].read()                  # the deferred mode's one read (nothing for per_step)
            side["cpu"].append((time.process_time() - c0) / len(batches))
            side["losses"] += [m["loss"] for m in metrics]
    a, b = sides["per_step"], sides["deferred"]
    assert a["losses"] == b["losses"], "the two modes must train identically"
    per, dfr = statistics.median(a["cpu"]), statistics.median(b["cpu"])
    return {"donate_state": donate, "read_every": read_every, "steps": len(a["losses"]) - 1,
            "per_step_cpu_ms": 1e3 * per, "deferred_cpu_ms": 1e3 * dfr, "ratio_deferred_per_step": dfr / per,
            "first_loss": a["losses"][0]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--read-every", type=int, default=10)
    p.add_argument("--donate", choices=["both", "on", "off"], default="both")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for donate in {"both": (True, False), "on": (True,), "off": (False,)}[args.donate]:
        print(json.dumps(run(args.steps, args.read_every, donate)), flush=True)


if __name__ == "__main__":
    main()
