"""The memory levers on one device: predicted (``plan.estimate`` + ``plan.cost``) and, on a GPU,
measured, each beside the step without levers.

    python benchmarks/memory_levers.py                    # Llama-3.2-1B, 4 x 2048, bf16: predicted (CPU, ~3 min)
    python benchmarks/memory_levers.py --measure          # also measured, on CUDA device 0
    python benchmarks/memory_levers.py --smoke --measure  # a tiny model on the CPU (tested in the suite)
    python benchmarks/memory_levers.py --write            # the predicted table into README.md

Levers (``--levers``): ``none``; ``full`` (``remat=True``: each layer recomputed in backward);
``selective`` (``remat="selective"``: matmul and attention results kept, the rest recomputed);
``selective_alternate`` (torchtitan's op policy: the same with every second matmul recomputed);
``offload_params`` (master weights, gradients and optimizer state on the host, the update
there); ``activation_offloading`` (saved activations to pinned host memory; CUDA only).
The model is ``benchmarks/gpu.py``'s 1B row (16 layers, tied embeddings), AdamW, donated
state, eager (a compiled step refuses the two offload levers today).

Predicted: the dry run's device peak, what the CUDA caching allocator reserves for it, the
host memory, and the step time on one GPU of ``--cluster`` (``plan.cost``). Measured
(``--measure``): ``torch.cuda.max_memory_allocated`` over one step after warm-up (the
state's bytes included) and the median step time; on the CPU the peak is not measured
(the time is). Levers run one after another from the same initial weights, and the first
losses of each must equal the lever-free step's (the levers change memory, not numbers).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import functional_pp as fpp  # noqa: E402
from functional_pp.app.report import human_bytes  # noqa: E402
from functional_pp import plan  # noqa: E402
from functional_pp.models import llama  # noqa: E402

LEVERS = {
    "none": {},
    "full": {"remat": True},
    "selective": {"remat": "selective"},
    "selective_alternate": {"remat": "selective_alternate"},
    "offload_params": {"offload_params": True},
    "activation_offloading": {"activation_offloading": True},
}
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
BEGIN, END = "<!-- memory-levers:begin -->", "<!-- memory-levers:end -->"


def model_config(smoke: bool) -> llama.Config:
    if smoke:
        return llama.Config(vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, mlp=128, rope_theta=10000.0,
                            rope_scaling=None, norm_eps=1e-5, max_seq=512, tie_embeddings=True)
    return llama.Config.llama3_1b(layers=16, tie_embeddings=True, rope_scaling=None, max_seq=2048)


def _optimizer():
    return fpp.optim.adamw(3e-4, weight_decay=0.1)


def predict(cfg: llama.Config, batch: int, seq: int, lever: str, cluster: str) -> dict:
    """The dry run of one bf16 step with ``lever`` on one device, and its time on ``cluster``."""
    kw = dict(LEVERS[lever])
    remat = kw.pop("remat", False)
    est = plan.estimate(functools.partial(llama.loss, cfg=cfg), llama.init(cfg), fpp.Mesh(),
                            llama.default_rules(tp=False),
                            {k: ((batch, seq), "batch seq") for k in ("tokens", "labels")},
                            optimizer=_optimizer(), precision="bf16", remat=remat, options=kw, timeline=False)
    t = plan.cost(est, cluster)
    return {"peak_bytes": est.peak_bytes, "reserved_bytes": est.reserved_bytes, "host_bytes": est.host_bytes,
            "step_s": t.step_s, "tokens_per_s": batch * seq / t.step_s}


def measure(cfg: llama.Config, batch: int, seq: int, lever: str, device: str, steps: int) -> dict:
    """One lever's real step on ``device``: first losses, peak memory (CUDA), median step time."""
    kw = dict(LEVERS[lever])
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), _optimizer(), precision="bf16",
                          donate_state=True, **kw)
    state = step.init(fpp.init(llama.init, cfg, seed=0, device=device))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g).to(device)
    data = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    losses, times = [], []
    if device == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, data)
        losses.append(float(m["loss"]))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    del state, step
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"losses": losses[:3], "measured_peak_bytes": peak, "measured_step_s": statistics.median(times[1:] or times)}


def run(args) -> dict:
    cfg = model_config(args.smoke)
    batch, seq = (2, 64) if args.smoke else (4, 2048)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    rows = {}
    for lever in args.levers.split(","):
        if lever not in LEVERS:
            raise SystemExit(f"--levers: unknown lever {lever!r}; choose from {', '.join(LEVERS)}")
        rows[lever] = predict(cfg, batch, seq, lever, args.cluster)
        if args.measure and not (lever == "activation_offloading" and device != "cuda"):
            rows[lever].update(measure(cfg, batch, seq, lever, device, args.steps))
        print(json.dumps({lever: rows[lever]}), file=sys.stderr, flush=True)
    base = rows.get("none", {}).get("losses")
    for lever, row in rows.items():
        if base and row.get("losses") and lever != "none":
            rel = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], base))
            if rel > 2e-2:
                raise AssertionError(f"lever {lever}: first losses {row['losses']} differ from the step without "
                                     f"levers {base} (relative {rel:.3g})")
    return {"model": "tiny" if args.smoke else "llama-3.2-1b", "batch": batch, "seq": seq, "device": device,
            "cluster": args.cluster, "torch": torch.__version__, "rows": rows}


def table(out: dict) -> str:
    """The Markdown table of ``run``'s result."""
    measured = any("measured_step_s" in r for r in out["rows"].values())
    head = "| lever | device peak | reserved | host | step (predicted) |" + (" measured peak | measured step |" if measured else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    base = out["rows"].get("none", {}).get("peak_bytes")
    for lever, r in out["rows"].items():
        ratio = f" ({r['peak_bytes'] / base:.2f}x)" if base and lever != "none" else ""
        cells = [f"`{lever}`", human_bytes(r["peak_bytes"]) + ratio, human_bytes(r["reserved_bytes"]),
                 human_bytes(r["host_bytes"]) if r["host_bytes"] else "-", _ms(r["step_s"])]
        if measured:
            cells += [human_bytes(r["measured_peak_bytes"]) if r.get("measured_peak_bytes") else "-",
                      _ms(r["measured_step_s"]) if "measured_step_s" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 10 else f"{ms:.3g} ms"


def write_readme(text: str, path: str = README) -> None:
    """Replace the block between the memory-levers markers of README.md with ``text``."""
    with open(path) as f:
        readme = f.read()
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block")
    new = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: f"{BEGIN}\n{text}\n{END}", readme, flags=re.S)
    with open(path, "w") as f:
        f.write(new)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    ap.add_argument("--levers", default=",".join(LEVERS), help="levers to run, of " + ", ".join(LEVERS))
    ap.add_argument("--measure", action="store_true", help="also run the steps (CUDA if available)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per lever (the first is not timed)")
    ap.add_argument("--cluster", default="h200x8", help="cluster preset of the predicted step time")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    ap.add_argument("--write", action="store_true", help="write the predicted table into README.md")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = run(args)
    print(table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.write:
        write_readme(table(out))
    return out


if __name__ == "__main__":
    main()
