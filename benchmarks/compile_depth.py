"""Compile time against depth: the whole step compiled (``compile=True``), traced natively
(the default) or interpreted by dynamo (``FPP_STEP_TRACE=dynamo``; step/native_trace.py),
versus one compilation of the layer reused by every layer (``compile="per_layer"``,
functional_pp/compile/layer_compile.py). The first step's wall time (compilation included) minus the
second's, for a shallow and a deep Llama, each in a fresh process, with torch's time per
compile phase (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` for a cold inductor cache).

    python benchmarks/compile_depth.py                       # 2 vs 16 layers, inductor
    python benchmarks/compile_depth.py --backend aot_eager --layers 2 8
    python benchmarks/compile_depth.py --trace native      # skip the slow dynamo trace

Prints one JSON line per (mode, depth), then the deep/shallow ratio per mode; the target is
per_layer's ratio <= 1.5 (issue 10 item 4).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def one(mode: str, layers: int) -> dict:
    import functools

    import torch

    import functional_pp as fpp
    from functional_pp.models import llama

    torch.set_num_threads(1)
    cfg = llama.Config.tiny(layers=layers, hidden=128, mlp=256)
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-3), compile=mode)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (2, 33), generator=g)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    def device():
        state = step.init(fpp.init(llama.init, cfg, torch.float32, seed=0))
        times = []
        for _ in range(2):
            t = time.perf_counter()
            state, m = step(state, batch)
            times.append(time.perf_counter() - t)
        return times, m["loss"]
    (first, second), loss = fpp.launch(device, fpp.Mesh())[0]
    from torch._dynamo.utils import calculate_time_spent     # where the compilation went, by phase
    phases = {k: round(v, 2) for k, v in calculate_time_spent().items() if k in PHASES}
    return {"mode": mode, "layers": layers, "compile_s": round(first - second, 2),
            "step_s": round(second, 4), "loss": loss, "phases_s": phases}


# torch's compile phases reported per run: dynamo and AOT autograd's trace are the frame compile
# less the backend's; inductor's lowering is its compile less code_gen (which includes waiting
# for the C++ compiler, async_compile.wait)
PHASES = ("entire_frame_compile", "backend_compile", "inductor_compile", "code_gen", "async_compile.wait")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 16], metavar=("SHALLOW", "DEEP"))
    ap.add_argument("--backend", default="inductor", help="inductor or aot_eager")
    ap.add_argument("--trace", default="all", choices=["all", "native", "dynamo"],
                    help="which whole-step trace to time beside per-layer compilation")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "LAYERS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        mode = {"True": True}.get(args.one[0], args.one[0])
        print(json.dumps(one(mode, int(args.one[1]))))
        return
    whole = True if args.backend == "inductor" else args.backend
    per_layer = "per_layer" if args.backend == "inductor" else f"per_layer:{args.backend}"
    # (label, compile mode, FPP_STEP_TRACE): the whole step traced natively (the default) or
    # interpreted by dynamo (step/native_trace.py), and per-layer compilation
    modes = [("per_layer", per_layer, ""), ("whole_native", whole, ""), ("whole_dynamo", whole, "dynamo")]
    if args.trace != "all":
        modes = [m for m in modes if m[0] == "per_layer" or m[0].endswith(args.trace)]
    results = {}
    for label, mode, trace in modes:
        for layers in args.layers:
            env = {**os.environ, "FPP_STEP_TRACE": trace}
            out = subprocess.run([sys.executable, __file__, "--one", str(mode), str(layers)],
                                 capture_output=True, text=True, check=True, env=env)
            r = {"trace": label, **json.loads(out.stdout.strip().splitlines()[-1])}
            results[(label, layers)] = r
            print(json.dumps(r), flush=True)
    for label, _, _ in modes:
        lo, hi = (results[(label, n)]["compile_s"] for n in args.layers)
        print(json.dumps({"trace": label, "deep_over_shallow": round(hi / lo, 2)}))


if __name__ == "__main__":
    main()
