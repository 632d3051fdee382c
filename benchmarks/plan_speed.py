"""How long a dry-run takes: Llama 3 8B and 70B on 1024 devices (targets: < 10 s and < 20 s).

    python benchmarks/plan_speed.py
"""
import functools
import time

import torch

import functional_pp as fpp
from functional_pp import plan
from functional_pp.models import llama

CASES = [("Llama 3 8B", llama.Config.llama3_8b(), 10.0), ("Llama 3 70B", llama.Config.llama3_70b(), 20.0)]


def main() -> None:
    mesh = fpp.Mesh(dp_replicate=4, dp_shard=32, tp=8)       # 1024 devices: 128 nodes of 8
    batch = {"tokens": ((1024, 4096), "batch seq"), "labels": ((1024, 4096), "batch seq")}
    for name, cfg, target in CASES:
        t0 = time.perf_counter()
        est = plan.estimate(functools.partial(llama.loss, cfg=cfg), llama.init(cfg, torch.bfloat16), mesh,
                            llama.default_rules(sequence_parallel=True), batch, precision="bf16")
        t = plan.cost(est, "h100x8")
        seconds = time.perf_counter() - t0
        print(f"{name} on {mesh.size} devices ({mesh.describe() if hasattr(mesh, 'describe') else mesh}): "
              f"{seconds:.2f} s (target < {target:.0f} s) — peak {est.peak_bytes / 1e9:.1f} GB/device, "
              f"{est.comm_bytes / 1e9:.1f} GB sent/device, step {t.step_s:.2f} s, MFU {t.mfu:.2f}")


if __name__ == "__main__":
    main()
