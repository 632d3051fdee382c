"""The training loop behind ``functional-pp train``: a :class:`~functional_pp.config.TrainConfig`
in, a trained (and checkpointed) model out: the config's model family
(:mod:`functional_pp.models.family`; Llama unless ``model.family`` names another, docs/models.md).
(:mod:`functional_pp.step.train` is the training *step*; this module runs it in a loop with data,
checkpoints, logging and signals.)

``train(cfg, simulate=8)`` checks the config against the world size, loads the corpus, prints
the mesh, the rules, the parameter count and the per-device memory, then runs on every device
(simulated threads, or this process's rank under torchrun):

- a progress line (loss, tokens/s, ETA) and ``metrics.jsonl`` (one JSON line per step) from
  rank 0, written when the steps' metrics are read from the device: after the first step,
  every ``logging.log_every`` steps, before evaluations and checkpoints, and at the end
  (``metrics="deferred"``: no step waits for the device; docs/eager_overhead.md);
  the communication of the first step per mesh axis in ``comm_report.txt``;
- checkpoints (params, optimizer state, step, RNG, loader position, config) every
  ``checkpoint.save_every`` steps, at the end, and at the first step boundary after SIGTERM,
  SIGINT (Ctrl-C) or SIGHUP (app/signals.py: the run then ends with :class:`Interrupted`,
  exit status 143 / 130 / 129);
- ``resume=True`` continues from the newest checkpoint in the output directory, with losses
  bitwise equal to an uninterrupted run on the same mesh;
- ``loss.png`` at the end (matplotlib, Agg; skipped with a note without matplotlib).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Mapping

import torch

from functional_pp import checkpoint as ck
from functional_pp.app.agreement import check_agreement, run_fingerprint
from functional_pp.app.host_view import agree_to_stop, device_loader, is_lead, lead_value, save_on_devices
from functional_pp.app.metrics import read_metrics, trim_metrics
from functional_pp.app.optimizer import optimizer_from_config
from functional_pp.app.plot import plot_losses
from functional_pp.app.progress import Progress
from functional_pp.app.report import comm_report_text, describe, mesh_label, param_memory
from functional_pp.app.resume_check import check_resume_config, check_resume_tokens
from functional_pp.app.run_lock import RunLock
from functional_pp.app.signals import Interrupted, StopRequest
from functional_pp.app.stopping import StoppedEarly, Watch
from functional_pp.app.world import World, is_main_process, resolve_world
from functional_pp.checkpoint.hf import require_weights
from functional_pp.config import ConfigError, TrainConfig, model_family
from functional_pp.core.runtime import current_context
from functional_pp.core.seeds import check_seed
from functional_pp.core.tree import leaves_with_paths
from functional_pp.devices.launch import launch, under_torchrun
from functional_pp.ops import fake_quant

# World ... plot_losses: imported from here before the application modules were split
__all__ = ["train", "TrainResult", "World", "resolve_world", "describe", "Progress",
           "param_memory", "read_metrics", "plot_losses"]

METRICS = "metrics.jsonl"
PLOT = "loss.png"
COMM_REPORT = "comm_report.txt"
CHECKPOINTS = "checkpoints"


# the stop signals' flag (SIGTERM, SIGINT, SIGHUP; app/signals.py), named here for tests to replace
_StopRequest = StopRequest


# ----------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    """What :func:`train` returns (on the main process)."""

    output_dir: Path
    start_step: int                        # 0, or the checkpoint step resumed from
    final_step: int
    losses: list[float] = field(default_factory=list)   # this run's steps
    stopped: bool = False                  # stopped early by a signal (checkpoint saved)
    checkpoint: Path | None = None         # the newest checkpoint written
    comm_report: str | None = None


def train(cfg: TrainConfig, *, simulate: int | None = None, resume: bool = False,
          stop_after: int | None = None, stream: IO[str] | None = None,
          allow_config_change: bool = False, overwrite_output: bool = False) -> TrainResult | None:
    """Train as ``cfg`` says. ``simulate``: run the mesh on that many simulated devices
    (default: the mesh's size outside torchrun). ``resume``: continue from the newest
    checkpoint in the output directory. ``stop_after``: stop after that step with a checkpoint
    (returns; a stop signal instead ends with :class:`Interrupted`). ``allow_config_change``: resume even though the config
    differs from the checkpoint's in a way that breaks exact resumption. ``overwrite_output``:
    resume from a checkpoint elsewhere (``resume_from_checkpoint``) into an output directory
    that holds another run's checkpoints or metrics. Returns the main process's
    :class:`TrainResult` (None on other torchrun ranks). Config problems raise
    :class:`ConfigError` before any work; the output directory is locked for the run
    (app/run_lock.py: a second run on it is refused)."""
    lock = RunLock()
    try:
        return _train(cfg, lock, simulate=simulate, resume=resume, stop_after=stop_after, stream=stream,
                      allow_config_change=allow_config_change, overwrite_output=overwrite_output)
    finally:
        lock.release()


def _train(cfg: TrainConfig, lock: RunLock, *, simulate: int | None, resume: bool, stop_after: int | None,
           stream: IO[str] | None, allow_config_change: bool, overwrite_output: bool) -> TrainResult | None:
    """:func:`train`, the output directory locked with ``lock`` before anything is written there."""
    from functional_pp import adapters
    from functional_pp.app.evaluate import evaluate
    from functional_pp.app.inputs import (adapter_params, base_params, check_batches, frozen_and_adapters, load_data,
                                          model_config)
    from functional_pp.app.world import describe_device, peak_flops, select_device
    from functional_pp.core import comm
    from functional_pp.app import grpo_run
    from functional_pp.app.preference_run import (REFERENCE, load_pairs, pair_steps, preference_objective,
                                                  preference_spec, with_reference)
    from functional_pp.data import DataLoader, batch_shard
    from functional_pp.data.pair_loader import PairLoader
    from functional_pp.data.loader import to_device
    from functional_pp.devices.batched_run import per_device
    from functional_pp.parallel.init import init as init_named
    from functional_pp.step.train import DEFAULT_BATCH_DIMS

    world = resolve_world(cfg, simulate)
    cfg.validate(world.size, launcher=world.launcher)
    main = is_main_process()
    out = stream or sys.stdout
    mesh = cfg.mesh(world.size)
    rules = cfg.build_rules(mesh)
    family, model_cfg = model_family(cfg), model_config(cfg)
    if cfg.base_model is not None:        # its weights are read on the devices: missing ones found here
        try:
            require_weights(cfg.base_model)
        except ck.CheckpointError as exc:
            raise ConfigError(f"base_model {cfg.base_model!r}: {exc}") from exc
    base_decls = family.param_decls(model_cfg)
    lora = cfg.lora_config()
    grpo = grpo_run.grpo_settings(cfg) if grpo_run.is_grpo(cfg) else None    # rl: grpo | gdpo (online)
    # rl: dpo | ipo | orpo | simpo | kto (docs/preference.md); pref is also set (to grpo's spec) for GRPO
    pref = grpo if grpo is not None else preference_spec(cfg)
    if pref is None:
        loss_fn, decls, trainable = frozen_and_adapters(cfg, lora, functools.partial(family.loss, cfg=model_cfg),
                                                       base_decls)
    elif grpo is not None:
        loss_fn, decls, trainable, grpo_policy = grpo_run.grpo_objective_of(cfg, grpo, family, model_cfg, lora,
                                                                            base_decls)
        reward_funcs = grpo_run.reward_functions(cfg, grpo)        # imported before any work
    else:
        loss_fn, decls, trainable = preference_objective(cfg, pref, family, model_cfg, lora, base_decls)
    reference_copy = pref is not None and REFERENCE in decls
    policy_decls = {k: v for k, v in decls.items() if k != REFERENCE} if reference_copy else decls
    out_dir = cfg.output_dir()
    ckpt_dir = out_dir / CHECKPOINTS
    keep = cfg.checkpoint.keep_last
    manager = ck.CheckpointManager(ckpt_dir, keep_last=keep, rules=rules)
    # Axolotl: auto_resume_from_checkpoints: true (the newest checkpoint of the output
    # directory, if any) and resume_from_checkpoint: PATH (that checkpoint) both resume
    resume = resume or cfg.resume_from_checkpoint is True or isinstance(cfg.resume_from_checkpoint, str)
    load_dir = ckpt_dir
    if isinstance(cfg.resume_from_checkpoint, str):      # a checkpoint (root or step) elsewhere
        try:
            found = ck.format.resolve_checkpoint(cfg.resume_from_checkpoint)
        except ck.CheckpointError as exc:
            raise ConfigError(f"resume_from_checkpoint: {exc}") from exc
        load_dir, latest = found.parent, int(ck.format.read_index(found)["step"])
        if load_dir.resolve() == ckpt_dir.resolve():     # this output directory's own checkpoint
            load_dir = ckpt_dir
    else:
        latest = manager.latest() if ckpt_dir.is_dir() else None
    if latest is not None and not resume and load_dir == ckpt_dir:
        raise ConfigError(f"{out_dir} already holds checkpoints (newest: step {latest}); pass "
                          f"--resume to continue from it, or choose another --output")
    if load_dir != ckpt_dir and not overwrite_output:
        _refuse_other_runs_output(out_dir, ckpt_dir, manager, load_dir)
    if latest is not None and not allow_config_change:
        check_resume_config(load_dir / ck.format.step_dir_name(latest), cfg, cfg.global_batch(mesh, rules))

    try:
        check_seed(cfg.seed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    data = load_data(cfg) if pref is None else grpo_run.load_prompts(cfg, grpo) if grpo is not None else load_pairs(cfg)
    corpus = data.train
    if latest is not None and not allow_config_change:   # the checkpoint's tokens (or pairs)
        check_resume_tokens(load_dir / ck.format.step_dir_name(latest), corpus)
    if corpus.vocab_size > family.vocab_size(model_cfg):
        raise ConfigError(f"the corpus has vocabulary {corpus.vocab_size} but the model only "
                          f"{family.vocab_size(model_cfg)}; set model.vocab >= {corpus.vocab_size}")
    gb = cfg.global_batch(mesh, rules)
    accum = cfg.grad_accum(mesh, rules)
    if grpo is not None:
        prompts_per_step = grpo_run.prompts_per_step(gb, grpo, corpus)
        cfg.set_epochs(grpo_run.steps_per_epoch(corpus, prompts_per_step, grpo))
    else:
        cfg.set_epochs(check_batches(cfg, data, gb) if pref is None else pair_steps(corpus, gb, cfg))
    opt, schedule = optimizer_from_config(cfg)
    device = select_device(world.simulate, world.size, under_torchrun())
    if cfg.tf32 is not None:                   # TF32 matmuls on CUDA (no effect on the CPU)
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    batch_dims = {**DEFAULT_BATCH_DIMS, "segments": "batch seq"} if pref is None else corpus.batch_dims
    step_fn = _build_step(cfg, mesh, rules, family, model_cfg, loss_fn, opt,
                          trainable=trainable, grad_accum=accum, precision=cfg.precision,
                          policy=cfg.policy(), compile=cfg.compile,
                          **cfg.offload_options(),
                          on_nonfinite=cfg.on_nonfinite, lr_schedule=schedule,
                          max_consecutive_skips=cfg.max_consecutive_skips,
                          flops_per_token=family.flops_per_token(model_cfg, cfg.sequence_len),
                          peak_flops_per_device=cfg.peak_flops_per_device or peak_flops(device),
                          batch_dims=batch_dims,
                          donate_state=True,   # the loop never reads a step's input state again
                          metrics="deferred")  # read every log_every steps (docs/eager_overhead.md)
    # a pipeline's device holds only its stages' layers: each writes them to the checkpoint under
    # their logical names (the others are empty there), evaluations see the whole (logical)
    # state (docs/pipelines.md)
    whole = getattr(step_fn, "logical_state", lambda state: state)
    mine = getattr(step_fn, "stage_state", lambda state: state)
    metrics_path = out_dir / METRICS
    eval_every = cfg.eval_steps or cfg.logging.log_every

    loggers = None
    if main:
        _check_writable(out_dir)         # before the summary: fail before any work
        lock.acquire(out_dir)            # one run per output directory (app/run_lock.py)
        if load_dir == ckpt_dir and ckpt_dir.is_dir() and manager.latest() != latest:
            raise ConfigError(f"{ckpt_dir}: another run wrote checkpoints there while this one started "
                              f"(newest now: step {manager.latest()}); choose another --output")
        print(describe(cfg, world, mesh, rules, model_cfg, corpus,
                       device_text=describe_device(device, world.simulate, world.size, world.sim_mode),
                       val=data.val),
              file=out, flush=True)
        if grpo is not None:
            print(grpo_run.summary_line(grpo, prompts_per_step), file=out, flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        if latest is not None:
            bad = trim_metrics(metrics_path, latest)
            if bad:
                print(f"note: {metrics_path}: dropped {len(bad)} line(s) that were not JSON (line {bad[0]}: "
                      f"cut when the run stopped while writing it)", file=out, flush=True)
            where = manager.path(latest) if load_dir == ckpt_dir else load_dir
            print(f"resuming from {where} (step {latest})", file=out, flush=True)
        elif resume:
            print(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0", file=out, flush=True)
        try:
            from functional_pp.app.metrics import make_loggers
            loggers = make_loggers(cfg, out_dir, metrics_path, append=latest is not None)
        except ImportError as exc:
            raise ConfigError(str(exc)) from exc
    torch.manual_seed(cfg.seed)
    config_dict = cfg.to_dict()
    stop = _StopRequest()

    def specs(state: dict) -> dict:
        # (the optimizer state mirrors the trained parameters only: frozen ones hold none)
        return {"params": decls, "opt": ck.state_specs(state["opt_state"], step_fn.spec.trainable_tree(decls)),
                "rng": ck.PER_RANK}

    tok_dir = getattr(data.tokenizer, "dir", None)
    if cfg.tokens and tok_dir is not None:     # the tokenizer with the added tokens, for export
        tok_dir = out_dir / "tokenizer"
        if main:
            data.tokenizer.save(tok_dir)
    export_info = {"model_config": family.config_to_dict(model_cfg),
                   "tokenizer_dir": str(Path(tok_dir).resolve()) if tok_dir is not None else None,
                   "base_model": str(Path(cfg.base_model).resolve()) if cfg.base_model else None,
                   "lora": dataclasses.asdict(lora) if lora is not None else None}

    def save(state: dict, loader, step: int) -> Path:
        tree = {"params": state["params"], "opt": state["opt_state"], "step": state["step"],
                "skipped": state["skipped"], "rng": ck.rng_state()}
        return manager.save(step, tree, specs(state),
                            metadata={"loader": loader.state_dict(), **export_info},
                            config=config_dict)

    agreed = None if world.simulate else run_fingerprint(cfg, corpus)     # (processes: each read its own)

    def device_fn() -> dict:
        lead = is_lead()          # rank 0, or the one host of a batched run (app/host_view.py)
        if agreed is not None:    # every rank about to train on the same config, data and code
            ranks = tuple(range(mesh.size))
            check_agreement(agreed, lambda fp: current_context().backend.exchange_objects(fp, ranks))
        if cfg.base_model is not None and latest is None:
            params = per_device(lambda: base_params(cfg, model_cfg, base_decls, mesh, rules, device, decls))
            if lora is not None:      # the adapters: fresh (peft's init) or from lora_model_dir
                params = adapters.joined(params, per_device(lambda: adapter_params(cfg, decls, mesh, rules, device)))
        else:
            # (adapters included; a fresh run's reference is the copy below, a resumed one's the checkpoint's)
            params = init_named(lambda: policy_decls if latest is None else decls, mesh=mesh, rules=rules,
                                seed=cfg.seed, device=device)
        if reference_copy and latest is None:       # DPO's reference: the initial parameters, frozen
            params = with_reference(params, decls)
        if lora is not None and lora.dora and latest is None and cfg.lora_model_dir is None:
            from functional_pp.parallel.shard_map import use_rules
            with use_rules(rules):        # DoRA: each magnitude the norms of its weight (peft's init)
                params = adapters.init_magnitudes(params, lora)
        state = step_fn.init(params)
        # the rules own the split and order (data/device_batch.py); one loader per device in a batched run
        if grpo is not None:         # every device: the step's prompts, then its block of the rollout's batch
            loader = grpo_run.prompt_steps(corpus, prompts_per_step, cfg.seed)
            sampler = grpo_run.GRPOSampler(grpo, grpo_policy, data.tokenizer, reward_funcs, cfg.sequence_len,
                                           corpus.pad_id, grpo_run.GRPOSampler.stops_of(data.tokenizer), cfg.seed,
                                           cfg.max_steps)
            shard = batch_shard(mesh, rules)
        else:
            loader = device_loader(lambda shard: (DataLoader if pref is None else PairLoader)(
                corpus, global_batch_size=gb, seq_len=cfg.sequence_len, seed=cfg.seed, **shard), mesh, rules)
        val_loader = None if data.val is None else device_loader(lambda shard: (
            DataLoader if pref is None else PairLoader)(data.val, global_batch_size=gb, seq_len=cfg.sequence_len,
                                                        seed=cfg.seed, drop_last=False, **shard), mesh, rules)
        start = 0
        if latest is not None:
            want = specs(state)      # the structure: the checkpoint holds whole layers

            def restore() -> tuple:      # this device's shards (per device in a batched run)
                r = ck.load_checkpoint(load_dir, want, rules=rules, step=latest,
                                       keys=["params", "opt", "step", "skipped"], device=device)
                return r.tree, r.metadata["loader"], int(r.step)
            tree, loader_state, start = per_device(restore)
            state = mine({"params": tree["params"], "opt_state": tree["opt"],
                          "step": tree["step"], "skipped": tree["skipped"]})
            try:
                loader.load_state_dict(loader_state, check_tokens=not allow_config_change)
            except ValueError as exc:     # other data than the checkpoint's: resuming would mix them
                raise ConfigError(f"resuming from {load_dir}: {exc}. Restore the data, start a new run (another "
                                  f"output_dir), or pass --allow-config-change to continue on these tokens") from exc
            if grpo is not None:             # the checkpoint's generation key: the same samples follow
                sampler.key = loader.generation_key
            try:
                ck.set_rng_state(lead_value(lambda: ck.load_checkpoint(load_dir, step=latest,
                                                                       keys=["rng"]).tree["rng"]))
            except ck.CheckpointMismatchError:   # saved from another world size: keep ours
                pass
        progress = Progress(cfg.max_steps, start, cfg.logging.log_every, out) if lead else None
        if val_loader is not None and start == 0:
            e0 = evaluate(step_fn, whole(state), val_loader)
            if lead:
                loggers.log(0, {"eval_loss": e0})
                progress.eval_loss = e0
        losses: list[float] = []
        skipped_steps = [0]                        # this run's steps skipped as non-finite
        watch, halted = Watch.of(cfg), []          # why a stopping rule ended the run
        report_text = None
        last_saved, saved_path, stopped = start, None, False
        step = start
        t0 = time.perf_counter()
        unread: list[tuple[int, Mapping, float]] = []   # (step, its metrics, elapsed_s when it was enqueued)
        best = [None, False]         # save_strategy: best: (the best held-out loss so far, improved at the last read)
        higher_better = bool(cfg.greater_is_better)
        rollout_metrics: dict[int, dict] = {}            # GRPO: each unread step's generation metrics

        def read_and_log(with_eval: bool = False) -> None:
            """Read the unread steps' metrics (one transfer: the step's host checks raise here,
            naming the first failing step, once the steps before it are logged), evaluate if asked
            and log them (docs/eager_overhead.md "Host synchronisation")."""
            error = None
            try:
                step_fn.read()
            except Exception as exc:   # noqa: BLE001 (re-raised below)
                error = exc
            eval_loss = evaluate(step_fn, whole(state), val_loader) if with_eval and error is None else None
            best[1] = False
            if cfg.checkpoint.save_best and eval_loss is not None and (
                    best[0] is None or (eval_loss > best[0] if higher_better else eval_loss < best[0])):
                best[0], best[1] = eval_loss, True
            for i, (s, m, elapsed) in enumerate(unread):
                if getattr(m, "error", None) is not None:
                    break                    # the failing step and those after it
                m = {**dict(m), **rollout_metrics.pop(s, {})}
                losses.append(m["loss"])
                skipped_steps[0] += int(bool(m.get("skipped", 0)))
                why = watch.loss(s, m["loss"])
                if why is None and eval_loss is not None and i == len(unread) - 1:
                    why = watch.eval_loss(s, eval_loss)
                if why is not None and not halted:
                    halted.append(why)
                if eval_loss is not None and i == len(unread) - 1:
                    m["eval_loss"] = eval_loss
                if lead:
                    m["elapsed_s"] = elapsed
                    if latest is not None and s == start + 1:
                        m["resumed_from"] = start
                    loggers.log(s, m)
                    progress.update(s, m)
            unread.clear()
            if error is not None:
                raise error

        qat_after = (cfg.qat or {}).get("fake_quant_after_n_steps")
        try:
            while step < cfg.max_steps:
                asked = stop.event.is_set() or (stop_after is not None and step >= stop_after)
                if agree_to_stop(asked):
                    stopped = True
                    break
                if grpo is not None:     # sample with the current parameters, score, take this device's rows
                    batch, rollout_metrics[step + 1] = sampler.step_batch(step_fn, state["params"], loader, step,
                                                                          shard)
                else:
                    batch = next(loader)
                batch = to_device(batch, device)        # pinned + non-blocking on CUDA
                if qat_after is not None:                # qat.fake_quant_after_n_steps: off until then
                    fake_quant.set_enabled(step >= qat_after)
                if lead and report_text is None:
                    with comm.comm_report() as rep:
                        state, m = step_fn(state, batch)
                    report_text = comm_report_text(rep, step + 1, mesh, cfg)
                    (out_dir / COMM_REPORT).write_text(report_text + "\n")
                    progress.message(report_text)
                else:
                    state, m = step_fn(state, batch)
                step += 1
                unread.append((step, m, time.perf_counter() - t0))
                with_eval = val_loader is not None and (step % eval_every == 0 or step == cfg.max_steps)
                save_now = bool(cfg.checkpoint.save_every) and step % cfg.checkpoint.save_every == 0
                # read every log_every steps, after the first one, and before an evaluation or a
                # checkpoint: no checkpoint holds a state past an unreported error
                if with_eval or save_now or step % cfg.logging.log_every == 0 or step == start + 1:
                    read_and_log(with_eval)
                    save_now = save_now or (with_eval and best[1])      # save_strategy: best
                if save_now:
                    saved_path, last_saved = save_on_devices(lambda s: save(s, loader, step), state), step
                    if lead:
                        progress.message(f"saved checkpoint {saved_path}")
                if watch.threshold is not None and not halted:
                    read_and_log(False)                  # the watchdog sees every step's loss
                if halted:
                    break
            read_and_log()
            final = stopped or bool(halted) or cfg.checkpoint.save_final
            if final and step != last_saved:
                saved_path, last_saved = save_on_devices(lambda s: save(s, loader, step), state), step
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
        return {"start": start, "step": step, "losses": losses, "stopped": stopped, "halted": halted,
                "checkpoint": saved_path, "comm_report": report_text, "skipped": skipped_steps[0]}

    fake_quant.set_enabled(True)     # (QAT's switch as a run starts; the devices turn it off before
    #                                   fake_quant_after_n_steps, each at the same step boundary)
    with stop:     # until the end: a second signal while finishing changes nothing (app/signals.py)
        results = launch(device_fn, mesh, simulate=world.launch_mode, timeout=cfg.collective_timeout)
        if not world.simulate:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        r = results[0] if world.simulate else results
        interrupted = None
        if r["stopped"] and stop.signal is not None:
            interrupted = Interrupted(f"received {stop.signal}: stopped at step {r['step']}/{cfg.max_steps} with "
                                      f"checkpoint {r['checkpoint'] or manager.path(r['step'])}; continue with "
                                      f"--resume", stop.signal)
        if not main:
            if interrupted is not None:
                raise interrupted
            return None
        if cfg.logging.plot:
            metrics = read_metrics(metrics_path)
            if metrics and plot_losses(metrics, out_dir / PLOT, title=f"{cfg.name}: {mesh_label(mesh)}"):
                print(f"loss curve: {out_dir / PLOT}", file=out)
            elif metrics:
                print("note: matplotlib is not installed; no loss.png (pip install matplotlib)", file=out)
        if r["halted"]:
            raise StoppedEarly(f"{r['halted'][0]} at step {r['step']}/{cfg.max_steps}; checkpoint "
                               f"{r['checkpoint']}")
        if interrupted is not None:
            raise interrupted
        if r["losses"] and r["skipped"] == len(r["losses"]):
            from functional_pp.step.train import NonFiniteError
            raise NonFiniteError(f"all {r['skipped']} steps of this run were skipped (non-finite loss, gradients "
                                 f"or update; see nonfinite_* in {metrics_path}): nothing was learned. Check "
                                 f"the base weights and the data for NaN / inf, or lower learning_rate")
        if r["losses"]:
            print(f"done: step {r['step']}/{cfg.max_steps}, loss {r['losses'][-1]:.4f}; metrics in "
                  f"{metrics_path}", file=out, flush=True)
        else:
            print(f"nothing to do: already at step {r['step']} of max_steps={cfg.max_steps}", file=out)
        return TrainResult(out_dir, r["start"], r["step"], r["losses"], r["stopped"], r["checkpoint"],
                           r["comm_report"])


def _build_step(cfg: TrainConfig, mesh, rules, family, model_cfg, loss, opt, **options):
    """The training step: :func:`~functional_pp.step.train.train_step`, or with a ``pp`` axis
    :func:`~functional_pp.step.pipeline.pipeline_step` (the config's schedule and virtual
    stages, the family's first- and last-stage parameters)."""
    from functional_pp.step.pipeline import FewMicroBatchesWarning, pipeline_step
    from functional_pp.step.train import train_step
    if "pp" not in mesh.shape:
        return train_step(loss, opt, mesh=mesh, rules=rules, **options)
    first, last = family.pipeline_ends(model_cfg) if family.pipeline_ends is not None else ((), ())
    try:
        with warnings.catch_warnings():     # the config check already warned (config/checks.py)
            warnings.simplefilter("ignore", FewMicroBatchesWarning)
            return pipeline_step(loss, opt, mesh=mesh, rules=rules, schedule=cfg.pp_schedule,
                                 virtual_stages=cfg.pp_virtual_stages, first_stage=first, last_stage=last,
                                 fsdp_gather=cfg.pp_fsdp_gather, **options)
    except ValueError as exc:
        raise ConfigError(f"pp_size {mesh.shape['pp']}: {exc}") from exc


def _refuse_other_runs_output(out_dir: Path, ckpt_dir: Path, manager, load_dir: Path) -> None:
    """Resuming from a checkpoint elsewhere (``resume_from_checkpoint``) into ``out_dir``:
    refuse when ``out_dir`` holds another run's checkpoints or metrics (they would be replaced
    and cut), naming both directories."""
    theirs = []
    newest = manager.latest() if ckpt_dir.is_dir() else None
    if newest is not None:
        theirs.append(f"checkpoints up to step {newest}")
    metrics = out_dir / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        theirs.append(METRICS)
    if theirs:
        raise ConfigError(f"resume_from_checkpoint: resuming from {load_dir} into output_dir {out_dir}, "
                          f"which already holds {' and '.join(theirs)} of another run: they would be "
                          f"overwritten. Choose a new output_dir (--output DIR) for the resumed run; to "
                          f"continue the run of {out_dir} itself, unset resume_from_checkpoint and pass "
                          f"--resume; or pass --overwrite-output to write into {out_dir} anyway")


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


