"""Full fine-tune vs LoRA vs QLoRA side by side in one run (issue 27):

1. the planner's bytes per device for a Llama 3 8B (``plan.estimate``: the real step on meta
   tensors, bf16 compute with fp32 master weights of the trained parameters and the frozen
   base in bf16, as ``functional-pp plan`` declares it, AdamW, remat): parameters, gradients and
   optimizer state, saved activations, the peak, and the bytes sent per step, on 1 and on 8
   devices (FSDP over ``dp_shard``);
2. the measured step of the tiny model on this machine's CPU for the three: median step time
   and peak memory (torch.profiler's CPU allocator events plus the live state, as
   benchmarks/single_device.py measures it).

LoRA is all-linear with ``r=32``, alpha 16; QLoRA the same adapters over an NF4 base with
double-quantized scales (the frozen base weights are codes and scales, gathered as such).

    python benchmarks/adapters.py                              # 8B on 1 and 8 devices, tiny on CPU
    python benchmarks/adapters.py --preset 1b --devices 1 --steps 3

Prints a table per part and one JSON line."""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import functional_pp as fpp
from functional_pp import adapters, plan
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.models.quantize import quantize_linear_weights, quantized_decls
from functional_pp.parallel import sharding

sys.path.insert(0, str(Path(__file__).resolve().parent))
from single_device import peak_memory  # noqa: E402

KINDS = ("full", "lora", "qlora")


def _setup(cfg: llama.Config, kind: str, r: int, dtype: torch.dtype = torch.float32):
    """``(loss, declarations, trainable mask)`` of one kind of fine-tune, the weights declared in
    ``dtype`` (a frozen base is held in it; trained weights get fp32 masters in the state)."""
    loss, decls = functools.partial(llama.loss, cfg=cfg), llama.init(cfg, dtype)
    if kind == "full":
        return loss, decls, None
    lc = adapters.LoraConfig(r=r, alpha=16, target_linear=True)
    loss, decls, mask = adapters.adapt(loss, lc), adapters.init(decls, lc), adapters.trainable(lc)
    if kind == "qlora":
        decls = quantized_decls(decls, "nf4", double_quant=True)
    return loss, decls, mask


def planned(preset: str, devices: list[int], r: int, batch: int, seq: int) -> list[dict]:
    cfg = llama.Config.preset(preset)
    rows = []
    for n in devices:
        mesh = fpp.Mesh(dp_shard=n) if n > 1 else fpp.Mesh()
        rules = llama.default_rules(tp=False) if n > 1 else fpp.Rules()
        shape = {"tokens": ((batch * n, seq), "batch seq"), "labels": ((batch * n, seq), "batch seq")}
        for kind in KINDS:
            loss, decls, mask = _setup(cfg, kind, r, torch.bfloat16)      # the compute dtype, as `plan` declares it
            est = plan.estimate(loss, decls, mesh, rules, shape, precision="bf16", remat=True, trainable=mask)
            rows.append({"devices": n, "kind": kind, "state_GiB": est.state_bytes / 2**30,
                         "weights_GiB": est.param_bytes / 2**30, "activations_GiB": est.activation_bytes / 2**30,
                         "peak_GiB": est.peak_bytes / 2**30, "sent_GiB": est.comm_bytes / 2**30})
    return rows


def measured(steps: int, r: int) -> list[dict]:
    cfg = llama.Config.tiny(hidden=256, mlp=512, heads=4, kv_heads=2)      # head_dim 64: whole NF4 blocks
    gen = [torch.Generator().manual_seed(i) for i in range(steps + 1)]
    batches = [{k: fpp.named(torch.randint(0, cfg.vocab, (4, 64), generator=g), "batch seq").data
                for k in ("tokens", "labels")} for g in gen]
    rows = []
    for kind in KINDS:
        loss, decls, mask = _setup(cfg, kind, r)
        if kind == "qlora":       # the base quantized from full weights, as a Hugging Face import is
            lora_decls = _setup(cfg, "lora", r)[1]
            full = tree.tree_map(lambda x: x.data, fpp.init(lambda: lora_decls, seed=0))
            qparams, decls = quantize_linear_weights(full, lora_decls, "nf4", double_quant=True)
            params = sharding.named_tree(qparams, decls)
        else:
            params = fpp.init(lambda: decls, seed=0)
        step = fpp.train_step(loss, fpp.optim.adamw(1e-3), trainable=mask)
        state = step.init(params)
        state, m = step(state, batches[0])                      # warm-up
        times = []
        for b in batches[1:]:
            t0 = time.perf_counter()
            state, m = step(state, b)
            times.append(time.perf_counter() - t0)
        runner = _Runner(step, state)
        mem = peak_memory(runner, batches[-1], "cpu")
        rows.append({"kind": kind, "step_ms": 1e3 * statistics.median(times), "peak_MB": mem["peak_bytes"] / 1e6,
                     "state_MB": mem["state_bytes"] / 1e6, "loss": float(m["loss"])})
    return rows


class _Runner:
    """What ``single_device.peak_memory`` measures: one step, and the live state."""
    def __init__(self, step, state):
        self._step, self.state = step, state

    def step(self, batch):
        self.state, _ = self._step(self.state, batch)

    def live_state(self):
        return self.state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--r", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="sequences per device")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    plans = planned(a.preset, a.devices, a.r, a.batch, a.seq)
    print(f"planned, Llama {a.preset}, {a.batch} x {a.seq} tokens per device, bf16 + fp32 master, AdamW, remat:")
    print(f"{'devices':>7} {'kind':>6} {'state GiB':>10} {'weights':>8} {'activ.':>7} {'peak GiB':>9} {'sent GiB':>9}")
    for row in plans:
        print(f"{row['devices']:>7} {row['kind']:>6} {row['state_GiB']:>10.2f} {row['weights_GiB']:>8.2f} "
              f"{row['activations_GiB']:>7.2f} {row['peak_GiB']:>9.2f} {row['sent_GiB']:>9.2f}")
    runs = measured(a.steps, a.r)
    print("measured, tiny Llama (hidden 256, 2 layers), 4 x 64 tokens, CPU:")
    for row in runs:
        print(f"  {row['kind']:>6}: {row['step_ms']:.1f} ms per step, peak {row['peak_MB']:.1f} MB "
              f"(state {row['state_MB']:.1f} MB), loss {row['loss']:.4f}")
    print(json.dumps({"planned": plans, "measured": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
