"""Compile time of a compiled training step on 1 vs N simulated devices (one JSON line).

    python benchmarks/compile_once.py                          # FSDP, 1 vs 8 devices, aot_eager
    python benchmarks/compile_once.py --layout tp --devices 1,4 --backend inductor

Each device count runs in a fresh process (nothing cached from the other). The tiny Llama
(2 layers) trains with ``compile=--backend``; device 0 times the first step (compilation +
one step) and a second step; ``compile_s`` = first - second. ``graphs`` is how many graphs
dynamo compiled in the process: with compile-once (docs/compile.md) one for every layout
whose traced code does not depend on the device (DP, FSDP, HSDP), else one per distinct
device (TP and CP read the device's index along their axis).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

LAYOUTS = {"dp": ("dp_shard", 'fpp.Rules(batch="dp_shard")'),
           "fsdp": ("dp_shard", 'fpp.Rules(batch="dp_shard", hidden="dp_shard")'),
           "tp": ("tp", "llama.default_rules()")}

_CHILD = r"""
import functools, json, sys, time, torch
import functional_pp as fpp
from functional_pp.models import llama
from torch._dynamo.utils import counters
n, axis, rules_src, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
cfg = llama.Config.tiny(layers=2)
mesh = fpp.Mesh(**{axis: n})
rules = eval(rules_src)
step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-3), mesh=mesh, rules=rules,
                      compile=backend)
B = 8
def device():
    toks = torch.randint(0, cfg.vocab, (B, 33), generator=torch.Generator().manual_seed(0))
    dp = mesh.shape["dp_shard"]
    r, k = (fpp.axis_index("dp_shard") if dp > 1 else 0), B // dp
    batch = {"tokens": toks[r * k:(r + 1) * k, :32], "labels": toks[r * k:(r + 1) * k, 1:]}
    state = step.init(fpp.init(llama.init, cfg, mesh=mesh, rules=rules, seed=0))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        times.append(time.perf_counter() - t0)
    return times, m["loss"]
times, loss = fpp.launch(device, mesh, timeout=3600)[0]
print(json.dumps({"devices": n, "first_step_s": times[0], "step_s": times[1], "compile_s": times[0] - times[1],
                  "graphs": counters["stats"]["unique_graphs"], "loss": loss}))
"""


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="fsdp")
    ap.add_argument("--devices", default="1,8")
    ap.add_argument("--backend", default="aot_eager", help="aot_eager or inductor")
    args = ap.parse_args(argv)
    axis, rules = LAYOUTS[args.layout]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    runs = {}
    for n in (int(d) for d in args.devices.split(",")):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(n), axis, rules, args.backend],
                             capture_output=True, text=True, env=env, timeout=3600)
        if out.returncode:
            raise SystemExit(f"{n} devices failed:\n{out.stderr[-3000:]}")
        runs[n] = json.loads(out.stdout.strip().splitlines()[-1])
    base = runs[min(runs)]
    result = {"layout": args.layout, "backend": args.backend, "runs": runs,
              "compile_ratio": {str(n): r["compile_s"] / base["compile_s"] for n, r in runs.items()}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
