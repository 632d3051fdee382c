"""The training loop behind ``functional-pp train``: a :class:`~functional_pp.config.TrainConfig`
in, a trained (and checkpointed) Llama model out.

``train(cfg, simulate=8)`` checks the config against the world size, loads the corpus, prints
the mesh, the rules, the parameter count and the per-device memory, then runs on every device
(simulated threads, or this process's rank under torchrun):

- a progress line (loss, tokens/s, ETA) and ``metrics.jsonl`` (one JSON line per step) from
  rank 0; the communication of the first step per mesh axis in ``comm_report.txt``;
- checkpoints (params, optimizer state, step, RNG, loader position, config) every
  ``checkpoint.save_every`` steps, at the end, and at the first step boundary after SIGTERM;
- ``resume=True`` continues from the newest checkpoint in the output directory, with losses
  bitwise equal to an uninterrupted run on the same mesh;
- ``loss.png`` at the end (matplotlib, Agg; skipped with a note without matplotlib).
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from . import checkpoint as ck
from .config import ConfigError, TrainConfig
from .seeds import check_seed
from .launch import launch, under_torchrun
from .layout import local_shape
from .models import llama
from .plot import plot_losses
from .tree import count_params, leaves_with_paths

__all__ = ["train", "TrainResult", "World", "resolve_world", "describe", "Progress",
           "param_memory", "read_metrics", "plot_losses"]

METRICS = "metrics.jsonl"
PLOT = "loss.png"
COMM_REPORT = "comm_report.txt"
CHECKPOINTS = "checkpoints"


# ----------------------------------------------------------------------------- world
@dataclass(frozen=True)
class World:
    """How many devices run and how: simulated threads, or one rank per process (torchrun)."""

    size: int
    simulate: bool
    launcher: str          # where the device count comes from, for messages


def resolve_world(cfg: TrainConfig, simulate: int | None = None) -> World:
    """The world the run will use: torchrun's ``WORLD_SIZE``, ``--simulate N``, or (outside
    torchrun, without accelerators) the mesh's own size on simulated devices."""
    if under_torchrun():
        n = int(os.environ["WORLD_SIZE"])
        if simulate is not None:
            raise ConfigError(f"--simulate {simulate} cannot be used under torchrun (which already "
                              f"runs {n} processes); drop one of them")
        return World(n, False, f"torchrun (WORLD_SIZE={n})")
    if simulate is not None:
        if simulate < 1:
            raise ConfigError(f"--simulate needs a device count >= 1, got {simulate}")
        return World(simulate, True, f"--simulate {simulate}")
    n = math.prod(cfg.mesh_sizes(None).values())
    if n > 1 and torch.cuda.is_available():
        raise ConfigError(f"the mesh needs {n} devices: launch with `torchrun --nproc_per_node {n} "
                          f"-m functional_pp train ...`, or pass --simulate {n} to run them as "
                          f"simulated devices in this process")
    return World(n, True, "simulated devices" if n > 1 else "one device")


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0" if under_torchrun() else True


# ----------------------------------------------------------------------------- reporting
def param_memory(decls: Any, mesh, rules) -> tuple[int, int]:
    """(global parameter count, parameters held by each device) for ``decls`` under the rules
    (every device holds equal blocks)."""
    local = 0
    for path, d in leaves_with_paths(decls):
        local += math.prod(local_shape(d.shape, rules.resolve(d.axes, d.shape, mesh, name=path), mesh))
    return count_params(decls), local


def _state_bytes_per_param(cfg: TrainConfig) -> tuple[int, str]:
    if cfg.optimizer == "adamw":
        return 16, "fp32 AdamW: weights 4 + grads 4 + moments 8"
    if cfg.momentum:
        return 12, "fp32 SGD with momentum: weights 4 + grads 4 + momentum 4"
    return 8, "fp32 SGD: weights 4 + grads 4"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n}"


def describe(cfg: TrainConfig, world: World, mesh, rules, model_cfg, corpus=None, *,
             device_text: str | None = None, val=None) -> str:
    """The start-of-run summary: device, mesh, rules, parameter count, per-device parameter
    memory, batch, data and output."""
    decls = llama.init(model_cfg)
    total, local = param_memory(decls, mesh, rules)
    per, what = _state_bytes_per_param(cfg)
    dp = cfg.dp_size(mesh, rules)
    accum = cfg.grad_accum(mesh, rules)
    gb = cfg.global_batch(mesh, rules)
    mesh_txt = " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
    rules_txt = ", ".join(f"{k}={'+'.join(rules[k]) if rules[k] else '-'}" for k in rules.entries())
    model_txt = ", ".join(f"{k}={getattr(model_cfg, k)}" for k in
                          ("layers", "hidden", "heads", "kv_heads", "mlp", "vocab"))
    lines = [
        f"functional_pp train: {cfg.name} on {world.size} device(s) ({world.launcher})",
        f"mesh:       {mesh_txt} = {mesh.size} devices",
        f"rules:      {rules_txt}",
        f"model:      llama {cfg.base_model or cfg.model.preset} ({model_txt}): {total:,} parameters",
        f"memory:     {local:,} parameters on each device x {per} B ({what}) = "
        f"{_human_bytes(local * per)} per device (of {_human_bytes(total * per)} unsharded)",
        f"batch:      {gb} sequences x {cfg.sequence_len} tokens = {gb * cfg.sequence_len:,} tokens/step "
        f"(micro_batch_size {cfg.micro_batch_size} x grad_accum {accum} x dp {dp})",
        f"optimizer:  {cfg.optimizer}, lr {cfg.learning_rate:g} ({cfg.lr_scheduler}, warmup "
        f"{cfg.warmup()}), {cfg.max_steps} steps, precision {cfg.precision}"
        + (", activation checkpointing" if cfg.activation_checkpointing else "")
        + (f", compile={cfg.compile}" if cfg.compile else ""),
    ]
    if device_text is not None:
        lines.insert(1, f"device:     {device_text}")
    if corpus is not None:
        docs = f", {corpus.documents:,} documents" if hasattr(corpus, "documents") else ""
        held = f"; held out: {len(val):,} tokens" if val is not None else ""
        lines.append(f"data:       {corpus.name}: {len(corpus):,} tokens{docs}, vocab {corpus.vocab_size}{held}")
    for note in cfg.notes:
        lines.append(f"not used:   {note}")
    lines.append(f"output:     {cfg.output_dir()}")
    return "\n".join(lines)


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """Plain-text progress: ``\\r``-updated on a terminal, one line per ``log_every`` steps
    otherwise; shows loss, held-out loss (once known), lr, gradient norm, tokens/s (smoothed),
    MFU (when the peak FLOP/s are known), ETA and elapsed time."""

    def __init__(self, total: int, start: int = 0, log_every: int = 10,
                 stream: IO[str] | None = None, tty: bool | None = None, width: int = 20):
        self.total, self.start, self.log_every, self.width = total, start, log_every, width
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._t0: float | None = None
        self._s0 = start
        self._open = False
        self._tps: float | None = None          # exponential moving average of tokens/s
        self.eval_loss: float | None = None
        self._started = time.perf_counter()

    def line(self, step: int, metrics: dict, now: float | None = None) -> str:
        """The progress text after ``step``."""
        now = time.perf_counter() if now is None else now
        if self._t0 is None or step <= self._s0:
            eta = float("nan")
        else:   # time per step measured after the first step (compilation, warm-up)
            eta = (now - self._t0) / (step - self._s0) * (self.total - step)
        done = int(self.width * step / max(self.total, 1))
        bar = "#" * done + "." * (self.width - done)
        tps = self._tps if self._tps is not None else metrics.get("tokens_per_s", float("nan"))
        parts = [f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {metrics['loss']:.4f}"]
        if self.eval_loss is not None:
            parts.append(f"eval {self.eval_loss:.4f}")
        if "lr" in metrics:
            parts.append(f"lr {metrics['lr']:.2e}")
        if "grad_norm" in metrics:
            parts.append(f"gnorm {metrics['grad_norm']:.3g}")
        parts.append(f"{tps:,.0f} tok/s")
        if metrics.get("mfu") is not None:
            parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
        parts.append(f"ETA {_fmt_time(eta)}")
        parts.append(f"{_fmt_time(now - self._started)} elapsed")
        return " | ".join(parts)

    def update(self, step: int, metrics: dict) -> None:
        now = time.perf_counter()
        if "eval_loss" in metrics:
            self.eval_loss = metrics["eval_loss"]
        tps = metrics.get("tokens_per_s")
        if tps is not None and math.isfinite(tps) and step > self.start + 1:   # skip warm-up
            self._tps = tps if self._tps is None else 0.9 * self._tps + 0.1 * tps
        text = self.line(step, metrics, now)
        if self._t0 is None:
            self._t0, self._s0 = now, step
        if self.tty:
            self.stream.write("\r" + text + " " * 4)
            self._open = True
            if step >= self.total:
                self.stream.write("\n")
                self._open = False
        elif step % self.log_every == 0 or step >= self.total or step == self.start + 1:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a line without garbling the progress line."""
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The lines of a ``metrics.jsonl`` file."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _trim_metrics(path: Path, last_step: int) -> None:
    """Keep the lines of steps <= ``last_step`` (a resumed run rewrites the later ones)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


# ----------------------------------------------------------------------------- SIGTERM
class _StopRequest:
    """A flag set by SIGTERM (handler installed from the main thread only)."""

    def __init__(self):
        self.event = threading.Event()
        self.signal: str | None = None
        self._old = None

    def __enter__(self) -> "_StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name
        self.event.set()

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


# ----------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    """What :func:`train` returns (on the main process)."""

    output_dir: Path
    start_step: int                        # 0, or the checkpoint step resumed from
    final_step: int
    losses: list[float] = field(default_factory=list)   # this run's steps
    stopped: bool = False                  # stopped early by SIGTERM (checkpoint saved)
    checkpoint: Path | None = None         # the newest checkpoint written
    comm_report: str | None = None


# optimizer argument -> config key, so that a refused setting is named as the user wrote it
_OPTIMIZER_CONFIG_KEYS = {"b1": "adam_beta1", "b2": "adam_beta2", "eps": "adam_epsilon", "min_lr": "min_learning_rate",
                          "end_value": "min_learning_rate", "max_norm": "max_grad_norm", "total_steps": "max_steps",
                          "peak": "learning_rate", "value": "learning_rate"}


def _optimizer(cfg: TrainConfig):
    """The optimizer and the learning-rate schedule of ``cfg``; a setting the optimizer
    constructors refuse is a ConfigError naming the config key."""
    try:
        return _build_optimizer(cfg)
    except (TypeError, ValueError) as exc:
        found = re.search(r": (\w+)=", str(exc))
        key = _OPTIMIZER_CONFIG_KEYS.get(found.group(1), found.group(1)) if found else None
        raise ConfigError(f"optimizer settings: {exc}" + (f" [config key: {key}]" if key else "")) from exc


def _build_optimizer(cfg: TrainConfig):
    from . import optim
    kw = dict(learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
              max_grad_norm=cfg.max_grad_norm, lr_schedule=cfg.lr_scheduler,
              warmup_steps=cfg.warmup(), total_steps=cfg.max_steps,
              min_lr=cfg.min_lr(), mask=optim.decay_mask_by_ndim)
    if cfg.optimizer == "adamw":
        kw.update(b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon)
    else:
        kw.update(momentum=cfg.momentum)
    schedule = optim.make_schedule(cfg.learning_rate, cfg.lr_scheduler, cfg.warmup(),
                                   cfg.max_steps, cfg.min_lr())
    if not callable(schedule):
        schedule = optim.schedules.constant(schedule)
    return optim.from_config(cfg.optimizer, **kw), schedule


def train(cfg: TrainConfig, *, simulate: int | None = None, resume: bool = False,
          stop_after: int | None = None, stream: IO[str] | None = None,
          allow_config_change: bool = False) -> TrainResult | None:
    """Train as ``cfg`` says. ``simulate``: run the mesh on that many simulated devices
    (default: the mesh's size outside torchrun). ``resume``: continue from the newest
    checkpoint in the output directory. ``stop_after``: stop after that step as if SIGTERM had
    arrived (checkpoint, clean exit). ``allow_config_change``: resume even though the config
    differs from the checkpoint's in a way that breaks exact resumption. Returns the main
    process's :class:`TrainResult` (None on other torchrun ranks). Config problems raise :class:`ConfigError` before any work."""
    from . import comm
    from .collectives import axis_index, axis_size
    from .data import DataLoader
    from .init import init as init_named
    from .evaluate import evaluate
    from .finetune import (base_params, check_batches, describe_device, load_data, model_config,
                           peak_flops, select_device)
    from .runtime import current_context
    from .train import DEFAULT_BATCH_DIMS, train_step

    world = resolve_world(cfg, simulate)
    cfg.validate(world.size, launcher=world.launcher)
    main = _is_main_process()
    out = stream or sys.stdout
    mesh = cfg.mesh(world.size)
    rules = cfg.build_rules(mesh)
    model_cfg = model_config(cfg)
    decls = llama.init(model_cfg)
    out_dir = cfg.output_dir()
    ckpt_dir = out_dir / CHECKPOINTS
    keep = cfg.checkpoint.keep_last
    manager = ck.CheckpointManager(ckpt_dir, keep_last=keep, rules=rules)
    resume = resume or cfg.resume_from_checkpoint is True
    load_dir = ckpt_dir
    if isinstance(cfg.resume_from_checkpoint, str):      # a checkpoint (root or step) elsewhere
        try:
            found = ck.format.resolve_checkpoint(cfg.resume_from_checkpoint)
        except ck.CheckpointError as exc:
            raise ConfigError(f"resume_from_checkpoint: {exc}") from exc
        load_dir, latest = found.parent, int(ck.format.read_index(found)["step"])
    else:
        latest = manager.latest() if ckpt_dir.is_dir() else None
    if latest is not None and not resume and load_dir == ckpt_dir:
        raise ConfigError(f"{out_dir} already holds checkpoints (newest: step {latest}); pass "
                          f"--resume to continue from it, or choose another --output")
    if latest is not None and not allow_config_change:
        _check_resume_config(load_dir / ck.format.step_dir_name(latest), cfg, cfg.global_batch(mesh, rules))

    try:
        check_seed(cfg.seed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    data = load_data(cfg)
    corpus = data.train
    if corpus.vocab_size > model_cfg.vocab:
        raise ConfigError(f"the corpus has vocabulary {corpus.vocab_size} but the model only "
                          f"{model_cfg.vocab}; set model.vocab >= {corpus.vocab_size}")
    gb = cfg.global_batch(mesh, rules)
    accum = cfg.grad_accum(mesh, rules)
    cfg.set_epochs(check_batches(cfg, data, gb))
    opt, schedule = _optimizer(cfg)
    device = select_device(world.simulate, world.size, under_torchrun())
    if cfg.tf32 is not None:                   # TF32 matmuls on CUDA (no effect on the CPU)
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    batch_dims = {**DEFAULT_BATCH_DIMS, "segments": "batch seq"}     # packed documents
    step_fn = train_step(functools.partial(llama.loss, cfg=model_cfg), opt, mesh=mesh, rules=rules,
                         grad_accum=accum, precision=cfg.precision,
                         remat=cfg.activation_checkpointing, compile=cfg.compile,
                         on_nonfinite=cfg.on_nonfinite, lr_schedule=schedule,
                         max_consecutive_skips=cfg.max_consecutive_skips,
                         flops_per_token=llama.flops_per_token(model_cfg, cfg.sequence_len),
                         peak_flops_per_device=cfg.peak_flops_per_device or peak_flops(device),
                         batch_dims=batch_dims)
    b_axes = cfg.batch_axes(mesh, rules)
    s_axes = cfg.seq_axes(mesh, rules)
    metrics_path = out_dir / METRICS
    eval_every = cfg.eval_steps or cfg.logging.log_every

    loggers = None
    if main:
        _check_writable(out_dir)         # before the summary: fail before any work
        print(describe(cfg, world, mesh, rules, model_cfg, corpus,
                       device_text=describe_device(device, world.simulate, world.size), val=data.val),
              file=out, flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        if latest is not None:
            _trim_metrics(metrics_path, latest)
            where = manager.path(latest) if load_dir == ckpt_dir else load_dir
            print(f"resuming from {where} (step {latest})", file=out, flush=True)
        elif resume:
            print(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0", file=out, flush=True)
        try:
            from .metrics_log import make_loggers
            loggers = make_loggers(cfg, out_dir, metrics_path, append=latest is not None)
        except ImportError as exc:
            raise ConfigError(str(exc)) from exc
    torch.manual_seed(cfg.seed)
    config_dict = cfg.to_dict()
    stop = _StopRequest()

    def specs(state: dict) -> dict:
        return {"params": decls, "opt": ck.state_specs(state["opt_state"], decls), "rng": ck.PER_RANK}

    export_info = {"model_config": model_cfg.to_dict(),
                   "tokenizer_dir": str(data.tokenizer.dir.resolve()) if data.tokenizer is not None
                   and hasattr(data.tokenizer, "dir") else None,
                   "base_model": str(Path(cfg.base_model).resolve()) if cfg.base_model else None}

    def save(state: dict, loader, step: int) -> Path:
        tree = {"params": state["params"], "opt": state["opt_state"], "step": state["step"],
                "skipped": state["skipped"], "rng": ck.rng_state()}
        return manager.save(step, tree, specs(state),
                            metadata={"loader": loader.state_dict(), **export_info},
                            config=config_dict)

    def agree_to_stop(local: bool) -> bool:
        """Every device stops at the same step boundary if any of them was asked to."""
        if mesh.size == 1:
            return local
        return any(current_context().backend.exchange_objects(local, tuple(range(mesh.size))))

    def device_fn() -> dict:
        lead = current_context().rank == 0
        if cfg.base_model is not None and latest is None:
            params = base_params(cfg, model_cfg, decls, mesh, rules, device)
        else:
            params = init_named(llama.init, model_cfg, mesh=mesh, rules=rules, seed=cfg.seed,
                                device=device)
        state = step_fn.init(params)
        dp = (axis_index(b_axes), axis_size(b_axes)) if b_axes else (0, 1)
        cp = (axis_index(s_axes), axis_size(s_axes)) if s_axes else (0, 1)
        loader = DataLoader(corpus, global_batch_size=gb, seq_len=cfg.sequence_len, seed=cfg.seed,
                            dp_rank=dp[0], dp_size=dp[1], cp_rank=cp[0], cp_size=cp[1],
                            cp_balanced=rules.splits_balanced("seq", s_axes))    # the rules own the order
        val_loader = None if data.val is None else DataLoader(
            data.val, global_batch_size=gb, seq_len=cfg.sequence_len, seed=cfg.seed, drop_last=False,
            dp_rank=dp[0], dp_size=dp[1], cp_rank=cp[0], cp_size=cp[1], cp_balanced=rules.splits_balanced("seq", s_axes))
        start = 0
        if latest is not None:
            r = ck.load_checkpoint(load_dir, specs(state), rules=rules, step=latest,
                                   keys=["params", "opt", "step", "skipped"], device=device)
            state = {"params": r.tree["params"], "opt_state": r.tree["opt"],
                     "step": r.tree["step"], "skipped": r.tree["skipped"]}
            loader.load_state_dict(r.metadata["loader"])
            start = int(r.step)
            try:
                ck.set_rng_state(ck.load_checkpoint(load_dir, step=latest, keys=["rng"]).tree["rng"])
            except ck.CheckpointMismatchError:   # saved from another world size: keep ours
                pass
        progress = Progress(cfg.max_steps, start, cfg.logging.log_every, out) if lead else None
        if val_loader is not None and start == 0:
            e0 = evaluate(step_fn, state, val_loader)
            if lead:
                loggers.log(0, {"eval_loss": e0})
                progress.eval_loss = e0
        losses: list[float] = []
        report_text = None
        last_saved, saved_path, stopped = start, None, False
        step = start
        t0 = time.perf_counter()
        try:
            while step < cfg.max_steps:
                asked = stop.event.is_set() or (stop_after is not None and step >= stop_after)
                if agree_to_stop(asked):
                    stopped = True
                    break
                batch = next(loader)
                if device is not None:
                    batch = {k: v.to(device) for k, v in batch.items()}
                if lead and report_text is None:
                    with comm.comm_report() as rep:
                        state, m = step_fn(state, batch)
                    report_text = _comm_report_text(rep, m["step"], mesh, cfg)
                    (out_dir / COMM_REPORT).write_text(report_text + "\n")
                    progress.message(report_text)
                else:
                    state, m = step_fn(state, batch)
                step = int(m["step"])
                losses.append(m["loss"])
                if val_loader is not None and (step % eval_every == 0 or step == cfg.max_steps):
                    m = dict(m, eval_loss=evaluate(step_fn, state, val_loader))
                if lead:
                    m = dict(m, elapsed_s=time.perf_counter() - t0)
                    if latest is not None and step == start + 1:
                        m["resumed_from"] = start
                    loggers.log(step, m)
                    progress.update(step, m)
                if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
                    saved_path, last_saved = save(state, loader, step), step
                    if lead:
                        progress.message(f"saved checkpoint {saved_path}")
            final = stopped or cfg.checkpoint.save_final
            if final and step != last_saved:
                saved_path, last_saved = save(state, loader, step), step
                if lead:
                    progress.message(f"saved checkpoint {saved_path}")
            if lead and stopped:
                why = (f"received {stop.signal}" if stop.signal else "asked to stop"
                       + (f" after step {stop_after}" if stop_after is not None else ""))
                progress.message(f"{why}: stopped at step {step} with checkpoint "
                                 f"{manager.path(step)}; continue with --resume")
        finally:
            if lead and loggers is not None:
                loggers.close()
        return {"start": start, "step": step, "losses": losses, "stopped": stopped,
                "checkpoint": saved_path, "comm_report": report_text}

    with stop:
        results = launch(device_fn, mesh, simulate=world.simulate, timeout=cfg.collective_timeout)
    if not world.simulate:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    if not main:
        return None
    r = results[0] if world.simulate else results
    if cfg.logging.plot:
        metrics = read_metrics(metrics_path)
        if metrics and plot_losses(metrics, out_dir / PLOT, title=f"{cfg.name}: {mesh_label(mesh)}"):
            print(f"loss curve: {out_dir / PLOT}", file=out)
        elif metrics:
            print("note: matplotlib is not installed; no loss.png (pip install matplotlib)", file=out)
    if r["losses"]:
        print(f"done: step {r['step']}/{cfg.max_steps}, loss {r['losses'][-1]:.4f}; metrics in "
              f"{metrics_path}", file=out, flush=True)
    else:
        print(f"nothing to do: already at step {r['step']} of max_steps={cfg.max_steps}", file=out)
    return TrainResult(out_dir, r["start"], r["step"], r["losses"], r["stopped"], r["checkpoint"],
                       r["comm_report"])


def _check_resume_config(ckpt: Path, cfg: TrainConfig, global_batch: int) -> None:
    """Refuse a resume whose config changes what the run computes (docs/bad_inputs.md §7)."""
    from .checkpoint.format import read_index
    from .resume_check import config_changes
    index = read_index(ckpt)
    saved = index.get("config")
    try:                                 # the saved run's global batch, on its own world size
        old = TrainConfig.from_dict(saved)
        old_mesh = old.mesh(index.get("world_size"))
        derived = ({"global batch (sequences per step)": old.global_batch(old_mesh, old.build_rules(old_mesh))},
                   {"global batch (sequences per step)": global_batch})
    except Exception:  # noqa: BLE001 - an older or foreign config: compare the keys as written
        derived = (None, None)
    changes = config_changes(saved, cfg.to_dict(), *derived)
    if changes:
        raise ConfigError(f"--resume: the config differs from the one saved in {ckpt} in "
                          f"{len(changes)} key(s) that change the results: " + "; ".join(changes)
                          + ". Restore them, or pass --allow-config-change to continue anyway "
                            "(the run will not equal an uninterrupted one)")


def _check_writable(out_dir: Path) -> None:
    """Create ``out_dir`` and check that files can be written there, before any work."""
    probe = out_dir / f".fpp-write-test-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"output directory {out_dir} is not writable ({exc.strerror or exc}); "
                          f"fix its permissions or choose another with --output DIR "
                          f"(logging.output_dir)") from exc


def mesh_label(mesh) -> str:
    """``dp_shard=2 x tp=2`` (axes of size > 1) or ``1 device``."""
    parts = [f"{a}={s}" for a, s in mesh.shape.items() if s > 1]
    return " x ".join(parts) or "1 device"


def _comm_report_text(rep, step: int, mesh, cfg: TrainConfig) -> str:
    head = f"communication of training step {step} on device 0 ({mesh_label(mesh)}), per mesh axis:"
    if cfg.compile:
        head += ("\n(note: compiled steps are not counted; set compile: false to see every "
                 "collective)")
    return head + "\n" + rep.table()
