"""Single-device training-step benchmark: the functional Llama (``fpp.train_step``) against the
same math written as a plain ``torch.nn.Module`` trained with ``torch.optim.AdamW``.

Both sides do one full step per call: forward + cross-entropy + backward + AdamW update, from
the SAME initial weights (the plain module is loaded from the functional parameters, and the
first-step losses are checked to agree before anything is timed).

    python benchmarks/single_device.py --preset small                  # eager and compiled
    python benchmarks/single_device.py --preset tiny --modes eager
    python benchmarks/single_device.py --compile-backend aot_eager --json out.json
    python benchmarks/single_device.py --device cuda --dtype bf16      # on a GPU

Timing: wall clock per step (device synchronised), median over ``--steps`` steps after
``--warmup`` steps (the first, compiling, step is reported separately). The functional and
plain steps are interleaved (A, B, A, B, ...) so that slow drifts of the machine hit both alike.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over one step (everything live on the
device, state included). On CPU there is no allocator high-water mark, so one extra step runs
under ``torch.profiler`` with ``profile_memory=True``: the running sum of its allocation/free
events gives the peak of bytes allocated *during* the step above what was live before it; the
reported peak is that plus the bytes of the state live at the start of the step (parameters,
optimizer state, batch; gradients are freed by the end of each step on both sides). It counts
tensors from torch's CPU allocator only (not Python objects, not the allocator caches of
MKL/oneDNN), so it is comparable between the two sides but is not the process RSS.

Differences that are part of what is measured (the functional step does them, the plain one
does not): the functional step also computes the global gradient norm and guards the update
against non-finite values (a scalar skip of the fused AdamW kernel in eager, one scalar select in
compiled steps, plus a check of the update's finiteness; docs/optim.md "In place",
functional_pp/step/update.py). With ``--no-donate-state`` it returns new parameter and moment
tensors instead of updating in place (eager: the new parameters are written into the step's own
gradient buffers, so nothing parameter-sized is allocated beyond the moments; docs/memory.md).
With ``--clip-norm X`` both sides clip the gradients by their global norm (plain torch:
``clip_grad_norm_(foreach=True)`` compiled with ``AdamW.step``), so plain torch computes the
gradient norm too, as LLM training usually does (torchtitan clips at 1.0 by default).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import functional_pp as fpp  # noqa: E402
from functional_pp.models import llama  # noqa: E402

# --------------------------------------------------------------------------- presets
PRESETS = {
    # model config overrides + batch shape
    "tiny": dict(model=dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128), batch=2, seq=64),
    "small": dict(model=dict(vocab=8192, hidden=512, layers=4, heads=8, kv_heads=4, mlp=1408), batch=4, seq=256),
}

OPT = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def make_config(preset: str, seq: int, loss_chunk_bytes: int | None = -1) -> llama.Config:
    """The preset's model; ``loss_chunk_bytes`` -1 keeps the model's default head + loss."""
    m = PRESETS[preset]["model"]
    chunk = {} if loss_chunk_bytes == -1 else {"loss_chunk_bytes": loss_chunk_bytes}
    return llama.Config(**m, rope_theta=10000.0, rope_scaling=None, norm_eps=1e-5,
                        tie_embeddings=False, max_seq=max(seq, 512), **chunk)


# --------------------------------------------------------------------------- plain model
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: llama.Config):
        super().__init__()
        self.h, self.k, self.d = cfg.heads, cfg.kv_heads, cfg.dim_head
        self.q_proj = nn.Linear(cfg.hidden, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, self.k * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, self.k * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.k, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.k, self.d).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: llama.Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.down_proj = nn.Linear(cfg.mlp, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: llama.Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class PlainLlama(nn.Module):
    def __init__(self, cfg: llama.Config, max_seq: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:        # one weight, as transformers ties it
            self.lm_head.weight = self.embed_tokens.weight
        d = cfg.dim_head
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(max_seq, dtype=torch.float64)[:, None] * inv[None, :]
        emb = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def plain_loss(model: PlainLlama, tokens, labels):
    logits = model(tokens)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


@torch.no_grad()
def load_from_functional(model: PlainLlama, params: dict, cfg: llama.Config) -> None:
    """Copy the functional parameters (input-dimension-first, heads split) into nn.Linear layouts."""
    def t(x):
        return x.data if isinstance(x, fpp.Named) else x

    H = cfg.hidden
    model.embed_tokens.weight.copy_(t(params["embed_tokens"]))                          # [V, H]
    model.norm.weight.copy_(t(params["norm"]))
    if not cfg.tie_embeddings:
        model.lm_head.weight.copy_(t(params["lm_head"]).T)                               # [H, V] -> [V, H]
    for blk, p in zip(model.layers, params["layers"]):
        a, m = p["self_attn"], p["mlp"]
        blk.input_layernorm.weight.copy_(t(p["input_layernorm"]))
        blk.post_attention_layernorm.weight.copy_(t(p["post_attention_layernorm"]))
        blk.self_attn.q_proj.weight.copy_(t(a["q_proj"]).reshape(H, -1).T)             # [H, N, D] -> [N*D, H]
        blk.self_attn.k_proj.weight.copy_(t(a["k_proj"]).reshape(H, -1).T)
        blk.self_attn.v_proj.weight.copy_(t(a["v_proj"]).reshape(H, -1).T)
        blk.self_attn.o_proj.weight.copy_(t(a["o_proj"]).reshape(-1, H).T)             # [N, D, H] -> [H, N*D]
        blk.mlp.gate_proj.weight.copy_(t(m["gate_proj"]).T)                             # [H, F] -> [F, H]
        blk.mlp.up_proj.weight.copy_(t(m["up_proj"]).T)
        blk.mlp.down_proj.weight.copy_(t(m["down_proj"]).T)                             # [F, H] -> [H, F]


# --------------------------------------------------------------------------- the two steps
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class FunctionalRunner:
    name = "functional"

    def __init__(self, cfg, params, compile_, precision, device, donate_state=True, clip_norm=None):
        opt = fpp.optim.adamw(OPT["lr"], b1=OPT["b1"], b2=OPT["b2"], eps=OPT["eps"],
                              weight_decay=OPT["weight_decay"], clip_norm=clip_norm)
        self.step_fn = fpp.train_step(functools.partial(llama.loss, cfg=cfg), opt, compile=compile_,
                                      precision=precision, donate_state=donate_state)
        self.state = self.step_fn.init(_clone_named(params))
        self.device = device

    def step(self, batch) -> float:
        self.state, m = self.step_fn(self.state, batch)
        sync(self.device)
        return m["loss"]

    def live_state(self):
        return self.state


def _clone_named(tree):
    import optree
    return optree.tree_map(lambda x: _named_clone(x), tree, is_leaf=lambda x: isinstance(x, fpp.Named),
                           none_is_leaf=False)


def _named_clone(x):
    return x.replace(data=x.data.detach().clone(), is_param=True)


class PlainRunner:
    name = "plain"

    def __init__(self, cfg, params, compile_, precision, device, seq, compile_optimizer=True, clip_norm=None):
        self.model = PlainLlama(cfg, max_seq=seq).to(device)
        load_from_functional(self.model, params, cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=OPT["lr"], betas=(OPT["b1"], OPT["b2"]),
                                     eps=OPT["eps"], weight_decay=OPT["weight_decay"], foreach=True, fused=False)
        self.device = device
        self.autocast = precision == "bf16"
        loss_fn = functools.partial(plain_loss, self.model)
        opt_step = self.opt.step
        if clip_norm is not None:      # torchtitan's idiom: clip by the global norm, then step
            params_list = list(self.model.parameters())

            def opt_step():
                torch.nn.utils.clip_grad_norm_(params_list, clip_norm, foreach=True)
                self.opt.step()
        if compile_:
            loss_fn = torch.compile(loss_fn, backend=compile_ if isinstance(compile_, str) else "inductor")
            if compile_optimizer:
                opt_step = torch.compile(opt_step, backend=compile_ if isinstance(compile_, str) else "inductor")
        self.loss_fn, self.opt_step = loss_fn, opt_step

    def step(self, batch) -> float:
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.loss_fn(batch["tokens"], batch["labels"])
        loss.backward()
        self.opt_step()
        self.opt.zero_grad(set_to_none=True)
        value = loss.item()
        sync(self.device)
        return value

    def live_state(self):
        return [list(self.model.parameters()), list(self.model.buffers()), list(self.opt.state.values())]


# --------------------------------------------------------------------------- memory
def _tensor_bytes(tree) -> int:
    import optree
    seen, total = set(), 0
    for x in optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, fpp.Named), none_is_leaf=False):
        if isinstance(x, fpp.Named):
            x = x.data
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            st = x.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def peak_memory(runner, batch, device: str) -> dict:
    """Peak memory of one step (see the module docstring for what is counted)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        runner.step(batch)
        return {"peak_bytes": int(torch.cuda.max_memory_allocated()), "state_bytes": int(before),
                "method": "torch.cuda.max_memory_allocated"}
    from torch.profiler import ProfilerActivity, profile
    state_bytes = _tensor_bytes([runner.live_state(), batch])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.step(batch)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return {"peak_bytes": int(state_bytes + peak), "state_bytes": int(state_bytes), "transient_peak_bytes": int(peak),
            "method": "torch.profiler memory events (CPU allocator) + live state"}


# --------------------------------------------------------------------------- driver
@dataclass
class Result:
    side: str
    mode: str
    first_step_s: float
    median_s: float
    mean_s: float
    min_s: float
    stdev_s: float
    times_s: list
    median_cpu_s: float           # process CPU time (all threads) per step: less sensitive to other load
    losses: list
    peak_bytes: int | None
    state_bytes: int | None
    memory_method: str


def make_batch(cfg, batch, seq, device, seed=1234):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g, dtype=torch.int64)
    return {"tokens": ids[:, :-1].contiguous().to(device), "labels": ids[:, 1:].contiguous().to(device)}


def run_mode(mode, cfg, params, batch, args) -> list[Result]:
    compile_ = False if mode == "eager" else (True if args.compile_backend == "inductor" else args.compile_backend)
    precision = args.dtype
    runners = [FunctionalRunner(cfg, params, compile_, precision, args.device,
                                donate_state=not args.no_donate_state, clip_norm=args.clip_norm),
               PlainRunner(cfg, params, compile_, precision, args.device, args.seq,
                           compile_optimizer=not args.no_compile_optimizer, clip_norm=args.clip_norm)]
    losses = {r.name: [] for r in runners}
    first = {}
    # first step of each (compiles when compiled) + the loss check
    for r in runners:
        t0 = time.perf_counter()
        losses[r.name].append(r.step(batch))
        first[r.name] = time.perf_counter() - t0
        print(f"  [{mode}] {r.name:10s} first step {first[r.name]:8.2f} s   loss {losses[r.name][0]:.6f}", flush=True)
    lf, lp = losses["functional"][0], losses["plain"][0]
    tol = 1e-4 if precision == "fp32" else 2e-2
    rel = abs(lf - lp) / abs(lp)
    print(f"  [{mode}] first-step loss functional {lf:.7f}  plain {lp:.7f}  rel diff {rel:.2e} (tol {tol:g})")
    assert rel <= tol, f"{mode}: first-step losses differ: functional {lf} vs plain {lp} (rel {rel:.3e} > {tol})"
    for _ in range(max(args.warmup - 1, 0)):
        for r in runners:
            losses[r.name].append(r.step(batch))
    # the optimizer must agree too: the second-step losses (after one AdamW update) are compared
    if len(losses["plain"]) >= 2:
        l2f, l2p = losses["functional"][1], losses["plain"][1]
        rel2 = abs(l2f - l2p) / abs(l2p)
        print(f"  [{mode}] second-step loss functional {l2f:.7f}  plain {l2p:.7f}  rel diff {rel2:.2e}")
        assert rel2 <= 10 * tol, f"{mode}: second-step losses differ ({l2f} vs {l2p}): optimizers disagree?"
    times = {r.name: [] for r in runners}
    cpu = {r.name: [] for r in runners}
    for i in range(args.steps):
        order = runners if i % 2 == 0 else runners[::-1]      # interleave, alternating who goes first
        for r in order:
            c0, t0 = time.process_time(), time.perf_counter()
            losses[r.name].append(r.step(batch))
            times[r.name].append(time.perf_counter() - t0)
            cpu[r.name].append(time.process_time() - c0)
    out = []
    for r in runners:
        mem = {"peak_bytes": None, "state_bytes": None, "method": "skipped"}
        if not args.no_memory:
            mem = peak_memory(r, batch, args.device)
        ts = times[r.name]
        out.append(Result(r.name, mode, first[r.name], statistics.median(ts), statistics.fmean(ts), min(ts),
                          statistics.stdev(ts) if len(ts) > 1 else 0.0, ts,
                          statistics.median(cpu[r.name]), losses[r.name],
                          mem["peak_bytes"], mem["state_bytes"], mem["method"]))
    del runners
    gc.collect()
    return out


def fmt_mib(b):
    return "n/a" if b is None else f"{b / 2**20:8.1f}"


def print_table(results: list[Result], args) -> list[dict]:
    by = {(r.mode, r.side): r for r in results}
    modes = [m for m in ("eager", "compiled") if (m, "functional") in by]
    rows = []
    label = {"eager": "eager", "compiled": f"compiled ({args.compile_backend})"}
    head = (f"{'mode':22s} | {'functional ms':>13s} {'plain ms':>9s} {'ratio':>6s} | "
            f"{'func peak MiB':>13s} {'plain peak MiB':>14s} {'ratio':>6s} | {'func 1st s':>10s} {'plain 1st s':>11s}")
    print()
    print(head)
    print("-" * len(head))
    for m in modes:
        f, p = by[(m, "functional")], by[(m, "plain")]
        tr = f.median_s / p.median_s
        mr = (f.peak_bytes / p.peak_bytes) if f.peak_bytes and p.peak_bytes else None
        print(f"{label[m]:22s} | {f.median_s * 1e3:13.1f} {p.median_s * 1e3:9.1f} {tr:6.3f} | "
              f"{fmt_mib(f.peak_bytes):>13s} {fmt_mib(p.peak_bytes):>14s} "
              f"{('%6.3f' % mr) if mr else '   n/a'} | {f.first_step_s:10.2f} {p.first_step_s:11.2f}")
        rows.append({"mode": m, "functional_median_s": f.median_s, "plain_median_s": p.median_s, "time_ratio": tr,
                     "functional_median_cpu_s": f.median_cpu_s, "plain_median_cpu_s": p.median_cpu_s,
                     "functional_peak_bytes": f.peak_bytes, "plain_peak_bytes": p.peak_bytes, "memory_ratio": mr})
    print("-" * len(head))
    print("ratio = functional / plain (lower is better for functional); times are medians of "
          f"{args.steps} steps after {args.warmup} warmup steps")
    if args.device == "cpu" and not args.no_memory:
        print("CPU peak memory = live state at step start + peak of torch CPU-allocator bytes during the step "
              "(torch.profiler memory events); not process RSS")
    for m in modes:
        f, p = by[(m, "functional")], by[(m, "plain")]
        print(f"  {m}: state at step start  functional {fmt_mib(f.state_bytes).strip()} MiB, "
              f"plain {fmt_mib(p.state_bytes).strip()} MiB;  step time stdev functional {f.stdev_s * 1e3:.1f} ms, "
              f"plain {p.stdev_s * 1e3:.1f} ms;  median process CPU time per step functional "
              f"{f.median_cpu_s * 1e3:.1f} ms, plain {p.median_cpu_s * 1e3:.1f} ms "
              f"(ratio {f.median_cpu_s / p.median_cpu_s:.3f})")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side and mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per side and mode (>= 1)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="compute dtype; bf16: functional precision='bf16' (fp32 master weights), "
                         "plain torch.autocast(bf16) over fp32 parameters")
    ap.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (inductor, aot_eager, ...)")
    ap.add_argument("--no-compile-optimizer", action="store_true",
                    help="plain compiled: compile only forward+loss(+backward), not optimizer.step")
    ap.add_argument("--batch", type=int, default=None, help="override the preset's batch size")
    ap.add_argument("--seq", type=int, default=None, help="override the preset's sequence length")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--clip-norm", type=float, default=None,
                    help="both sides clip gradients by their global norm (ours: adamw(clip_norm=); plain: "
                         "clip_grad_norm_(foreach=True) before AdamW.step, compiled with it): plain torch then "
                         "computes the gradient norm too, as LLM training does (torchtitan: max_norm 1.0)")
    ap.add_argument("--no-donate-state", action="store_true",
                    help="functional: return new parameter/moment tensors instead of updating the "
                         "state in place (the plain side updates in place)")
    ap.add_argument("--loss-chunk-bytes", type=int, default=-1,
                    help="functional: the LM head + cross-entropy over chunks of this many bytes of fp32 "
                         "logits (llama.Config.loss_chunk_bytes; 0: whole logits; -1: the model's default)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    ap.add_argument("--json", default=None, help="write all results to this file")
    args = ap.parse_args(argv)
    args.warmup = max(args.warmup, 1)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    args.batch = args.batch or preset["batch"]
    args.seq = args.seq or preset["seq"]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("eager", "compiled"):
            ap.error(f"unknown mode {m!r}")

    cfg = make_config(args.preset, args.seq, args.loss_chunk_bytes)
    n_params = fpp.count_params(llama.init(cfg))
    print(f"functional_pp single-device benchmark: preset {args.preset} ({n_params / 1e6:.2f} M params: "
          f"hidden {cfg.hidden}, layers {cfg.layers}, heads {cfg.heads}/{cfg.kv_heads}, mlp {cfg.mlp}, "
          f"vocab {cfg.vocab}, loss chunk {cfg.loss_chunk_bytes} B), batch {args.batch} x seq {args.seq}, {args.dtype}, {args.device}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {torch.get_num_threads()} threads, "
          f"steps {args.steps}, warmup {args.warmup}, AdamW {OPT}")
    load0 = os.getloadavg()
    cores = os.cpu_count() or 1
    print(f"load average {load0[0]:.2f} on {cores} cores")
    t0 = time.perf_counter()
    params = fpp.init(llama.init, cfg, seed=0, device=args.device)
    print(f"init {time.perf_counter() - t0:.1f} s")
    batch = make_batch(cfg, args.batch, args.seq, args.device)

    results = []
    for m in modes:
        results += run_mode(m, cfg, params, batch, args)
    rows = print_table(results, args)
    load1 = os.getloadavg()
    threads = torch.get_num_threads()
    others = max(load0[0], load1[0] - threads)       # the end-of-run load average includes this process
    if args.device == "cpu" and others > cores - threads + 0.5:
        print(f"WARNING: load average {load0[0]:.2f} at start, {load1[0]:.2f} at end on {cores} cores: other "
              f"processes may compete with the {threads} intra-op threads (the 1-minute average lags); wall "
              f"times, and CPU times of spinning threads, may be unreliable. Rerun on a quiet machine or "
              f"with --threads 1.")
    if args.json:
        toks = args.batch * args.seq
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "config": cfg.to_dict(), "n_params": n_params, "tokens_per_step": toks,
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "machine": platform.platform(), "loadavg_start": load0, "loadavg_end": load1,
                       "summary": rows,
                       "results": [asdict(r) for r in results]}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
