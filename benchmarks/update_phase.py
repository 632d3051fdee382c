"""The update phase of one training step alone, on the parameter shapes of a Llama preset: our
``step.update`` strategies (global gradient norm, optimizer, the update's finiteness check),
with donated state (AdamW's in-place step: one fused kernel pass) and without (the pure chain
in the step's own gradient buffers), against ``torch.optim.AdamW(foreach=True).step()`` and
``fused=True``. Process CPU time per call, the variants interleaved, medians.

    python benchmarks/update_phase.py                     # preset small (20.2 M parameters)
    python benchmarks/update_phase.py --preset tiny --repeats 50
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import optree  # noqa: E402
from single_device import OPT, make_config  # noqa: E402

import functional_pp as fpp  # noqa: E402
from functional_pp.models import llama  # noqa: E402
from functional_pp.step.update import choose_update  # noqa: E402


def _adamw():
    return fpp.optim.adamw(OPT["lr"], b1=OPT["b1"], b2=OPT["b2"], eps=OPT["eps"], weight_decay=OPT["weight_decay"])


class Ours:
    def __init__(self, params: list[torch.Tensor], donate: bool):
        self.opt, self.donate = _adamw(), donate
        self.update = choose_update(self.opt, donate_state=donate)
        self.params = [p.clone() for p in params]
        self.treespec = optree.tree_structure(self.params)
        self.state = self.opt.init(self.params)
        self.groups = [((), list(range(len(params))))]

    def __call__(self, grads: list[torch.Tensor]) -> float:
        grads = [g.clone() for g in grads]     # the step's own buffers (not timed)
        c0 = time.process_time()
        up = self.update.apply(grads, self.treespec, self.params, self.state, torch.tensor(1.0), self.groups)
        bool(up.finite)                        # the step's metrics read
        seconds = time.process_time() - c0
        self.params, self.state = up.params, up.opt_state
        return seconds


class Torch:
    def __init__(self, params: list[torch.Tensor], **kind):
        self.params = [p.clone().requires_grad_() for p in params]
        self.opt = torch.optim.AdamW(self.params, lr=OPT["lr"], betas=(OPT["b1"], OPT["b2"]), eps=OPT["eps"],
                                     weight_decay=OPT["weight_decay"], **kind)

    def __call__(self, grads: list[torch.Tensor]) -> float:
        for p, g in zip(self.params, grads):
            p.grad = g.clone()
        c0 = time.process_time()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.process_time() - c0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = make_config(args.preset, 256)
    params = [x.data for x in optree.tree_leaves(fpp.init(llama.init, cfg, seed=0))]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]
    sides = {"ours_donated": Ours(params, True), "ours_new_buffers": Ours(params, False),
             "torch_foreach": Torch(params, foreach=True), "torch_fused": Torch(params, fused=True)}
    times: dict = {k: [] for k in sides}
    for i in range(args.repeats + 2):
        for name, side in sides.items():
            t = side(grads)
            if i >= 2:
                times[name].append(t)
    out = {"preset": args.preset, "parameters": sum(p.numel() for p in params),
           "median_cpu_ms": {k: round(statistics.median(v) * 1e3, 1) for k, v in times.items()}}
    out["ours_donated/torch_foreach"] = round(out["median_cpu_ms"]["ours_donated"] / out["median_cpu_ms"]["torch_foreach"], 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
