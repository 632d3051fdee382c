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
from typing import IO, Mapping

import torch

from functional_pp import checkpoint as ck
from functional_pp.app.agreement import check_agreement, run_fingerprint
from functional_pp.app.host_view import agree_to_stop, device_loader, is_lead, lead_value, save_on_devices
from functional_pp.app.metrics import read_metrics, trim_metrics
from functional_pp.app.optimizer import check_lisa_layers, check_sparse_targets, optimizer_from_config
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
from functional_pp.devices.launch import launch, under_torchrun
from functional_pp.models import dropout_seeds
from functional_pp.ops import fake_quant
from functional_pp.devices.mesh_view import per_device

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
    (app/run_lock.py: a second run on it is refused). The phases are :class:`TrainRun`'s."""
    lock = RunLock()
    try:
        return TrainRun(cfg, lock, simulate=simulate, resume=resume, stop_after=stop_after, stream=stream,
                        allow_config_change=allow_config_change, overwrite_output=overwrite_output).run()
    finally:
        lock.release()


class TrainRun:
    """One :func:`train` call, a method per phase, in the order :meth:`run` calls them:

    - :meth:`setup`: the world, mesh, rules, model and objective (plain SFT, preference or GRPO);
    - :meth:`find_checkpoint`: the checkpoint to resume from (``resume`` or the config's
      ``resume_from_checkpoint``), refused where resuming would overwrite another run;
    - :meth:`load_data` and :meth:`build_step`: the corpus, the epochs, the optimizer and the step;
    - :meth:`open_output`: the main process locks the output directory, prints the summary and
      opens the metric loggers;
    - :meth:`launch`: every device runs a :class:`DeviceLoop` (init, resume, the step loop with
      its evaluations and checkpoints);
    - :meth:`finish`: the main process's ending: the loss plot, the errors that end a run, the
      last line and the :class:`TrainResult`.

    Everything a device reads is set on this object before :meth:`launch`; the devices write
    nothing back here (each returns its own results)."""

    def __init__(self, cfg: TrainConfig, lock: RunLock, *, simulate: int | None, resume: bool,
                 stop_after: int | None, stream: IO[str] | None, allow_config_change: bool, overwrite_output: bool):
        self.cfg, self.lock, self.simulate = cfg, lock, simulate
        self.resume, self.stop_after, self.out = resume, stop_after, stream or sys.stdout
        self.allow_config_change, self.overwrite_output = allow_config_change, overwrite_output

    def run(self) -> TrainResult | None:
        self.setup()
        self.find_checkpoint()
        self.load_data()
        self.build_step()
        self.open_output()
        torch.manual_seed(self.cfg.seed)
        self.config_dict = self.cfg.to_dict()
        self.stop = _StopRequest()
        self.prepare_export()
        fake_quant.set_enabled(True)     # (QAT's switch as a run starts; the devices turn it off before
        #                                   fake_quant_after_n_steps, each at the same step boundary)
        with self.stop:     # until the end: a second signal while finishing changes nothing (app/signals.py)
            return self.finish(self.launch())

    # ------------------------------------------------------------------ setup (host)
    def setup(self) -> None:
        """The world, mesh and rules; the model family, its parameters and the objective."""
        from functional_pp.app import ebft_run, grpo_run
        from functional_pp.app.diffusion_run import diffusion_objective
        from functional_pp.app.inputs import frozen_and_adapters, load_tokenizer, model_config
        from functional_pp.app.preference_run import REFERENCE, preference_objective, preference_spec
        cfg = self.cfg
        self.world = world = resolve_world(cfg, self.simulate)
        cfg.validate(world.size, launcher=world.launcher)
        self.main = is_main_process()
        self.mesh = cfg.mesh(world.size)
        self.rules = cfg.build_rules(self.mesh)
        self.family, self.model_cfg = family, model_cfg = model_family(cfg), model_config(cfg)
        if cfg.base_model is not None:        # its weights are read on the devices: missing ones found here
            try:
                require_weights(cfg.base_model)
            except ck.CheckpointError as exc:
                raise ConfigError(f"base_model {cfg.base_model!r}: {exc}") from exc
        self.base_decls = base_decls = family.param_decls(model_cfg)
        self.lora = lora = cfg.lora_config()
        if lora is not None and getattr(model_cfg, "score_head", None) is not None:   # (a reward model's head: saved)
            from functional_pp.app.reward_run import with_head_saved
            self.lora = lora = with_head_saved(lora, base_decls)
        self.grpo = grpo = grpo_run.grpo_settings(cfg) if grpo_run.is_grpo(cfg) else None    # rl: grpo | gdpo
        # rl: dpo | ipo | orpo | simpo | kto (docs/preference.md); pref is also set (to grpo's spec) for GRPO
        self.ebft = ebft = ebft_run.ebft_settings(cfg) if ebft_run.is_ebft(cfg) else None     # rl: ebft
        self.pref = pref = grpo if grpo is not None else ebft if ebft is not None else preference_spec(cfg)
        self.grpo_policy = self.reward_funcs = self.precompute_reference = self.ebft_features = None
        if pref is None:
            diffusion = cfg.diffusion_spec()          # (docs/finetune.md "Diffusion language models")
            loss = (functools.partial(family.loss, cfg=model_cfg) if diffusion is None else
                    diffusion_objective(cfg, diffusion, family, model_cfg, load_tokenizer(cfg)))
            self.loss_fn, self.decls, self.trainable = frozen_and_adapters(cfg, lora, loss, base_decls)
        elif grpo is not None:
            self.loss_fn, self.decls, self.trainable, self.grpo_policy = grpo_run.grpo_objective_of(
                cfg, grpo, family, model_cfg, lora, base_decls)
            self.reward_funcs = grpo_run.reward_functions(cfg, grpo)        # imported before any work
        elif ebft is not None:
            self.loss_fn, self.decls, self.trainable, self.grpo_policy, self.ebft_features = (
                ebft_run.ebft_objective_of(cfg, ebft, family, model_cfg, lora, base_decls))
        else:
            self.loss_fn, self.decls, self.trainable, self.precompute_reference = preference_objective(
                cfg, pref, family, model_cfg, lora, base_decls)
        decls = self.decls
        self.reference_copy = pref is not None and REFERENCE in decls
        self.policy_decls = {k: v for k, v in decls.items() if k != REFERENCE} if self.reference_copy else decls

    # ------------------------------------------------------------------ resume (host side)
    def find_checkpoint(self) -> None:
        """``self.latest``: the step to resume from (None: a fresh run), read from ``self.load_dir``
        (this output directory's checkpoints, or ``resume_from_checkpoint``'s)."""
        cfg = self.cfg
        self.out_dir = out_dir = cfg.output_dir()
        self.ckpt_dir = ckpt_dir = out_dir / CHECKPOINTS
        self.manager = manager = ck.CheckpointManager(ckpt_dir, keep_last=cfg.checkpoint.keep_last, rules=self.rules)
        # Axolotl: auto_resume_from_checkpoints: true (the newest checkpoint of the output
        # directory, if any) and resume_from_checkpoint: PATH (that checkpoint) both resume
        self.resume = resume = (self.resume or cfg.resume_from_checkpoint is True
                                or isinstance(cfg.resume_from_checkpoint, str))
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
        if load_dir != ckpt_dir and not self.overwrite_output:
            _refuse_other_runs_output(out_dir, ckpt_dir, manager, load_dir)
        if latest is not None and not self.allow_config_change:
            check_resume_config(load_dir / ck.format.step_dir_name(latest), cfg, cfg.global_batch(self.mesh,
                                                                                                   self.rules))
        self.load_dir, self.latest = load_dir, latest

    # ------------------------------------------------------------------ data and step (host)
    def load_data(self) -> None:
        """The corpus (text, pairs or prompts), checked against the checkpoint and the model; the
        global batch, the accumulation and the epochs."""
        from functional_pp.app import ebft_run, grpo_run
        from functional_pp.app.inputs import check_batches, load_data
        from functional_pp.app.preference_run import load_pairs, pair_steps
        cfg, grpo, mesh, rules = self.cfg, self.grpo, self.mesh, self.rules
        try:
            check_seed(cfg.seed)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.data = data = (load_data(cfg) if self.pref is None else grpo_run.load_prompts(cfg, grpo)
                            if grpo is not None else ebft_run.load_documents(cfg) if self.ebft is not None
                            else load_pairs(cfg))
        if self.precompute_reference is not None and self.latest is not None:
            from functional_pp.app.reference_logps import check_saved_reference_logps
            try:
                check_saved_reference_logps(self.load_dir.parent, data)
            except (FileNotFoundError, ValueError) as exc:
                raise ConfigError(str(exc)) from exc
        self.corpus = corpus = data.train
        if getattr(self.model_cfg, "score_head", None) is not None:    # (the pad id the export names: the data's)
            self.model_cfg = dataclasses.replace(self.model_cfg, pad_token_id=int(corpus.pad_id))
        if self.latest is not None and not self.allow_config_change:   # the checkpoint's tokens (or pairs)
            check_resume_tokens(self.load_dir / ck.format.step_dir_name(self.latest), corpus)
        vocab = self.family.vocab_size(self.model_cfg)
        if corpus.vocab_size > vocab:
            raise ConfigError(f"the corpus has vocabulary {corpus.vocab_size} but the model only "
                              f"{vocab}; set model.vocab >= {corpus.vocab_size}")
        self.gb = gb = cfg.global_batch(mesh, rules)
        self.accum = cfg.grad_accum(mesh, rules)
        self.prompts_per_step, self.eval_per_batch = None, 0
        if grpo is not None:
            self.prompts_per_step = grpo_run.prompts_per_step(gb, grpo, corpus)
            if data.val is not None:
                self.eval_per_batch = grpo_run.eval_prompts_per_batch(gb, grpo, data.val)
            cfg.set_epochs(grpo_run.steps_per_epoch(corpus, self.prompts_per_step, grpo))
        elif self.ebft is not None:            # documents per step: the global batch
            cfg.set_epochs(ebft_run.steps_per_epoch(corpus, gb))
        else:
            cfg.set_epochs(check_batches(cfg, data, gb) if self.pref is None else pair_steps(corpus, gb, cfg))

    def build_step(self) -> None:
        """The optimizer, the device and the training step (a pipeline step with a ``pp`` axis)."""
        from functional_pp.app.preference_run import REFERENCE
        from functional_pp.app.row_tokens import row_tokens
        from functional_pp.app.world import peak_flops, select_device
        from functional_pp.step.train import DEFAULT_BATCH_DIMS
        cfg, family, model_cfg = self.cfg, self.family, self.model_cfg
        check_lisa_layers(cfg, self.decls)
        check_sparse_targets(cfg, self.decls)
        opt, schedule = optimizer_from_config(cfg)
        self.device = device = select_device(self.world.simulate, self.world.size, under_torchrun())
        if cfg.tf32 is not None:                   # TF32 matmuls on CUDA (no effect on the CPU)
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
            torch.backends.cudnn.allow_tf32 = cfg.tf32
        batch_dims = {**DEFAULT_BATCH_DIMS, "segments": "batch seq"} if self.pref is None else self.corpus.batch_dims
        if getattr(model_cfg, "vision", None) is not None:       # (processor_type: the rows' images)
            from functional_pp.data.images import IMAGE_DIMS
            batch_dims = {**batch_dims, **IMAGE_DIMS}
        self.step_fn = step_fn = _build_step(
            cfg, self.mesh, self.rules, family, model_cfg, self.loss_fn, opt,
            copies=(REFERENCE,) if self.reference_copy else (),
            trainable=self.trainable, grad_accum=self.accum, precision=cfg.precision,
            policy=cfg.policy(), compile=cfg.compile,
            **cfg.offload_options(),
            on_nonfinite=cfg.on_nonfinite, lr_schedule=schedule,
            max_consecutive_skips=cfg.max_consecutive_skips,
            flops_per_token=family.flops_per_token(model_cfg, row_tokens(cfg, self.mesh, self.rules)),
            throughput_tokens="rows" if self.ebft is not None else "labels",   # (EBFT: every token of its rows)
            peak_flops_per_device=cfg.peak_flops_per_device or peak_flops(device),
            batch_dims=batch_dims,
            micro_weighting="labels" if cfg.diffusion is None else "rows",   # (the diffusion loss: a mean over rows)
            donate_state=True,   # the loop never reads a step's input state again
            metrics="deferred")  # read every log_every steps (docs/eager_overhead.md)
        # a pipeline's device holds only its stages' layers: each writes them to the checkpoint under
        # their logical names (the others are empty there), evaluations see the whole (logical)
        # state (docs/pipelines.md)
        self.whole = step_fn.logical_state
        self.whole_params = step_fn.logical_params      # (GRPO's sampling)
        self.mine = step_fn.stage_state
        self.metrics_path = self.out_dir / METRICS
        self.eval_every = cfg.eval_steps or cfg.logging.log_every

    # ------------------------------------------------------------------ the output directory (main process)
    def open_output(self) -> None:
        """On the main process: the output directory checked and locked, the summary printed, the
        metric loggers opened (appending when resuming)."""
        from functional_pp.app import grpo_run
        from functional_pp.app.world import describe_device
        self.loggers = None
        if not self.main:
            return
        cfg, out, out_dir, latest = self.cfg, self.out, self.out_dir, self.latest
        world, ckpt_dir, manager = self.world, self.ckpt_dir, self.manager
        _check_writable(out_dir)         # before the summary: fail before any work
        self.lock.acquire(out_dir)       # one run per output directory (app/run_lock.py)
        if self.load_dir == ckpt_dir and ckpt_dir.is_dir() and manager.latest() != latest:
            raise ConfigError(f"{ckpt_dir}: another run wrote checkpoints there while this one started "
                              f"(newest now: step {manager.latest()}); choose another --output")
        print(describe(cfg, world, self.mesh, self.rules, self.model_cfg, self.corpus,
                       device_text=describe_device(self.device, world.simulate, world.size, world.sim_mode),
                       val=self.data.val),
              file=out, flush=True)
        if self.grpo is not None:
            print(grpo_run.summary_line(self.grpo, self.prompts_per_step, self.data.val,
                                                          self.eval_per_batch), file=out, flush=True)
        if self.ebft is not None:
            from functional_pp.app import ebft_run
            print(ebft_run.summary_line(self.ebft, self.gb, len(self.base_decls["layers"])), file=out, flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        if latest is not None:
            bad = trim_metrics(self.metrics_path, latest)
            if bad:
                print(f"note: {self.metrics_path}: dropped {len(bad)} line(s) that were not JSON (line {bad[0]}: "
                      f"cut when the run stopped while writing it)", file=out, flush=True)
            where = manager.path(latest) if self.load_dir == ckpt_dir else self.load_dir
            print(f"resuming from {where} (step {latest})", file=out, flush=True)
        elif self.resume:
            print(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0", file=out, flush=True)
        try:
            from functional_pp.app.metrics import make_loggers
            self.loggers = make_loggers(cfg, out_dir, self.metrics_path, append=latest is not None)
        except ImportError as exc:
            raise ConfigError(str(exc)) from exc

    def prepare_export(self) -> None:
        """What a checkpoint's metadata holds for export (model config, tokenizer, base, LoRA);
        the tokenizer with added tokens saved beside the run; the run's fingerprint (processes)."""
        cfg, data, lora = self.cfg, self.data, self.lora
        tok_dir = getattr(data.tokenizer, "dir", None)
        if cfg.tokens and tok_dir is not None:     # the tokenizer with the added tokens, for export
            tok_dir = self.out_dir / "tokenizer"
            if self.main:
                data.tokenizer.save(tok_dir)
        self.export_info = {"model_config": self.family.config_to_dict(self.model_cfg),
                            "tokenizer_dir": str(Path(tok_dir).resolve()) if tok_dir is not None else None,
                            "base_model": str(Path(cfg.base_model).resolve()) if cfg.base_model else None,
                            "lora": dataclasses.asdict(lora) if lora is not None else None,
                            "loftq": cfg.loftq() if lora is not None else None}
        # (processes: each read its own data; the ranks check they agree before training)
        self.agreed = None if self.world.simulate else run_fingerprint(cfg, self.corpus)

    # ------------------------------------------------------------------ checkpoints
    def specs(self, state: dict) -> dict:
        """The checkpoint's structure for ``state`` (the optimizer state mirrors the trained
        parameters only: frozen ones hold none)."""
        return {"params": self.decls, "opt": ck.state_specs(state["opt_state"],
                                                            self.step_fn.spec.trainable_tree(self.decls)),
                "rng": ck.PER_RANK}

    def save(self, state: dict, loader, step: int) -> Path:
        """This device's checkpoint of ``state`` at ``step`` (run on every device)."""
        tree = {"params": state["params"], "opt": state["opt_state"], "step": state["step"],
                "skipped": state["skipped"], "rng": ck.rng_state()}
        return self.manager.save(step, tree, self.specs(state),
                                 metadata={"loader": loader.state_dict(), **self.export_info},
                                 config=self.config_dict)

    # ------------------------------------------------------------------ the devices
    def launch(self) -> dict:
        """Every device's :class:`DeviceLoop`; this process's results (rank 0's when simulated)."""
        results = launch(lambda: DeviceLoop(self).run(), self.mesh, simulate=self.world.launch_mode,
                         timeout=self.cfg.collective_timeout)
        if not self.world.simulate:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        return results[0] if self.world.simulate else results

    # ------------------------------------------------------------------ finish (host)
    def finish(self, r: dict) -> TrainResult | None:
        """The run's ending on this process: the loss plot, the error that ends a stopped, halted
        or all-skipped run, the last line, the :class:`TrainResult` (None off the main process)."""
        cfg, out, stop, metrics_path = self.cfg, self.out, self.stop, self.metrics_path
        interrupted = None
        if r["stopped"] and stop.signal is not None:
            interrupted = Interrupted(f"received {stop.signal}: stopped at step {r['step']}/{cfg.max_steps} with "
                                      f"checkpoint {r['checkpoint'] or self.manager.path(r['step'])}; continue with "
                                      f"--resume", stop.signal)
        if not self.main:
            if interrupted is not None:
                raise interrupted
            return None
        if cfg.logging.plot:
            metrics = read_metrics(metrics_path)
            if metrics and plot_losses(metrics, self.out_dir / PLOT, title=f"{cfg.name}: {mesh_label(self.mesh)}"):
                print(f"loss curve: {self.out_dir / PLOT}", file=out)
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
        untrained = r.get("untrained", 0)
        if r["losses"] and untrained == len(r["losses"]):
            raise NothingTrainedError(
                f"none of the {untrained} steps of this run trained a token: every label of their batches was "
                f"ignored (tokens 0 in {metrics_path}), so nothing was learned. The trained tokens are too few or "
                f"too far apart for these steps' windows (the start-up summary counts them per dataset): check "
                f"train_on_inputs / roles_to_train, and with sample_packing a few trained tokens at the end of "
                f"long rows (sample_packing: false trains each row in a window of its own)")
        if untrained:
            print(f"note: {untrained} of {len(r['losses'])} steps trained no token (every label of their batch "
                  f"ignored: tokens 0 in {metrics_path})", file=out)
        if r["losses"]:
            print(f"done: step {r['step']}/{cfg.max_steps}, loss {r['losses'][-1]:.4f}; metrics in "
                  f"{metrics_path}", file=out, flush=True)
        else:
            print(f"nothing to do: already at step {r['step']} of max_steps={cfg.max_steps}", file=out)
        return TrainResult(self.out_dir, r["start"], r["step"], r["losses"], r["stopped"], r["checkpoint"],
                           r["comm_report"])


class NothingTrainedError(RuntimeError):
    """A run none of whose steps trained a token (every label ignored): exit 1, not "done"."""


class DeviceLoop:
    """What one device does in a :class:`TrainRun` (the one host of every device in a batched
    run: app/host_view.py), a method per phase: :meth:`init_state`, :meth:`open_loaders`,
    :meth:`resume`, :meth:`first_eval`, :meth:`step_loop` (with :meth:`read_and_log`, the
    evaluations, and :meth:`save`), :meth:`finish`. Reads the run's settings from ``job``."""

    def __init__(self, job: TrainRun):
        self.job = job
        self.lead = is_lead()          # rank 0, or the one host of a batched run (app/host_view.py)
        self.sampler = self.shard = None
        self.start = 0
        self.losses: list[float] = []
        self.skipped_steps = 0                     # this run's steps skipped as non-finite
        self.untrained_steps = 0                   # this run's steps whose batch trained no label
        self.watch, self.halted = Watch.of(job.cfg), []     # why a stopping rule ended the run
        self.report_text = None
        self.saved_path, self.stopped = None, False
        self.unread: list[tuple[int, Mapping, float]] = []   # (step, its metrics, elapsed_s when it was enqueued)
        self.rollout_metrics: dict[int, dict] = {}            # GRPO: each unread step's generation metrics
        self.best_eval, self.improved = None, False   # save_strategy: best: the best held-out loss, improved at the last read

    def run(self) -> dict:
        self.init_state()
        self.precompute_reference()
        self.open_loaders()
        if self.job.latest is not None:
            self.resume()
        self.progress = Progress(self.job.cfg.max_steps, self.start, self.job.cfg.logging.log_every,
                                 self.job.out) if self.lead else None
        self.first_eval()
        try:
            self.step_loop()
            self.finish()
        finally:
            if self.lead and self.job.loggers is not None:
                self.job.loggers.close()
        return {"start": self.start, "step": self.step, "losses": self.losses, "stopped": self.stopped,
                "halted": self.halted, "checkpoint": self.saved_path, "comm_report": self.report_text,
                "skipped": self.skipped_steps, "untrained": self.untrained_steps}

    # ------------------------------------------------------------------ setup (device)
    def init_state(self) -> None:
        """The parameters (the base model's weights, or initialized; adapters; DPO's frozen
        reference; DoRA's magnitudes) and the step's state."""
        from functional_pp import adapters
        from functional_pp.app.inputs import adapter_params, base_params
        from functional_pp.app.preference_run import with_reference
        from functional_pp.parallel.init import init as init_named
        r = self.job
        cfg, mesh, rules, device, decls, lora, fresh = r.cfg, r.mesh, r.rules, r.device, r.decls, r.lora, r.latest is None
        if r.agreed is not None:    # every rank about to train on the same config, data and code
            ranks = tuple(range(mesh.size))
            check_agreement(r.agreed, lambda fp: current_context().backend.exchange_objects(fp, ranks))
        if cfg.base_model is not None and fresh and lora is not None and cfg.loftq() is not None:
            from functional_pp.app.inputs import loftq_params      # base and adapters from one LoftQ
            params = per_device(lambda: loftq_params(cfg, r.model_cfg, r.base_decls, decls, mesh, rules, device))
        elif cfg.base_model is not None and fresh:
            params = per_device(lambda: base_params(cfg, r.model_cfg, r.base_decls, mesh, rules, device, decls))
            if lora is not None:      # the adapters: fresh (peft's init) or from lora_model_dir
                params = adapters.joined(params, per_device(lambda: adapter_params(cfg, decls, mesh, rules, device)))
        else:
            # (adapters included; a fresh run's reference is the copy below, a resumed one's the checkpoint's)
            params = init_named(lambda: r.policy_decls if fresh else decls, mesh=mesh, rules=rules,
                                seed=cfg.seed, device=device)
        if r.reference_copy and fresh:       # DPO's reference: the initial parameters, frozen
            params = with_reference(params, decls)
        if lora is not None and lora.dora and fresh and cfg.lora_model_dir is None:
            from functional_pp.parallel.shard_map import use_rules
            with use_rules(rules):        # DoRA: each magnitude the norms of its weight (peft's init)
                params = adapters.init_magnitudes(params, lora)
        self.state = r.step_fn.init(params)

    def precompute_reference(self) -> None:
        """``precompute_ref_log_probs``: the reference's log-probabilities of every pair, one pass
        before the first step (a resumed run reads the fresh run's file), stored with the pairs
        (app/reference_logps.py)."""
        r = self.job
        if r.precompute_reference is None:
            return
        from functional_pp.app.reference_logps import attach_reference_logps
        run_dir = r.out_dir if r.latest is None else r.load_dir.parent      # (the resumed run's own)
        attach_reference_logps(r.step_fn, r.whole(self.state), r.precompute_reference, r.data, r.mesh, r.rules,
                               r.gb, r.cfg.sequence_len, run_dir, fresh=r.latest is None, lead=self.lead)

    def open_loaders(self) -> None:
        """This device's training and validation loaders (the rules own the split and order:
        data/device_batch.py; one loader per device in a batched run); GRPO's prompts and sampler."""
        from functional_pp.app import grpo_run
        from functional_pp.data import DataLoader, batch_shard
        from functional_pp.data.pair_loader import PairLoader
        r = self.job
        cfg, mesh, rules, corpus, gb = r.cfg, r.mesh, r.rules, r.corpus, r.gb
        kind = DataLoader if r.pref is None else PairLoader
        if r.grpo is not None:         # every device: the step's prompts, then its block of the rollout's batch
            self.loader = grpo_run.prompt_steps(corpus, r.prompts_per_step, cfg.seed)
            self.sampler = grpo_run.GRPOSampler(r.grpo, r.grpo_policy, r.data.tokenizer, r.reward_funcs,
                                                cfg.sequence_len, corpus.pad_id,
                                                grpo_run.GRPOSampler.stops_of(r.data.tokenizer), cfg.seed,
                                                cfg.max_steps, chunk_rows=cfg.micro_batch_size)
            self.shard = batch_shard(mesh, rules)
        elif r.ebft is not None:       # every device: the step's documents, then its block of the rollout's batch
            from functional_pp.app.ebft_run import EBFTSampler
            self.loader = grpo_run.prompt_steps(corpus, gb, cfg.seed)
            self.sampler = EBFTSampler(r.ebft, r.grpo_policy, r.ebft_features, corpus.pad_id, cfg.seed, r.accum)
            self.shard = batch_shard(mesh, rules)
        else:
            self.loader = device_loader(lambda shard: kind(corpus, global_batch_size=gb, seq_len=cfg.sequence_len,
                                                           seed=cfg.seed, **shard), mesh, rules)
        self.val_loader = None if r.data.val is None or r.grpo is not None else device_loader(lambda shard: kind(
            r.data.val, global_batch_size=gb, seq_len=cfg.sequence_len, seed=cfg.seed, drop_last=False, **shard),
            mesh, rules)
        self.perplexity_loaders = []        # do_causal_lm_eval: one held-out loader per perplexity window
        if cfg.do_causal_lm_eval and self.val_loader is not None and r.pref is None:
            from functional_pp.app.evaluate import perplexity_streams
            try:
                # rows just longer than the window, in a length every split of the sequence divides
                unit = 2 * mesh.size
                rows = min(cfg.sequence_len, -(-cfg.eval_max_new_tokens // unit) * unit)
                streams = perplexity_streams(r.data.val, r.data.tokenizer, cfg.eval_max_new_tokens, rows)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
            self.perplexity_loaders = [device_loader(lambda shard, t=t, m=m: DataLoader(
                t, trained=m, global_batch_size=gb, seq_len=rows, seed=cfg.seed, drop_last=False,
                **shard), mesh, rules) for t, m in streams]

    # ------------------------------------------------------------------ resume (device)
    def resume(self) -> None:
        """This device's shards of the checkpoint, the loader's position (its tokens checked),
        GRPO's generation key and the RNG state."""
        r = self.job
        latest, load_dir = r.latest, r.load_dir
        want = r.specs(self.state)      # the structure: the checkpoint holds whole layers

        def restore() -> tuple:      # this device's shards (per device in a batched run)
            got = ck.load_checkpoint(load_dir, want, rules=r.rules, step=latest,
                                     keys=["params", "opt", "step", "skipped"], device=r.device)
            return got.tree, got.metadata["loader"], int(got.step)
        tree, loader_state, self.start = per_device(restore)
        self.state = r.mine({"params": tree["params"], "opt_state": tree["opt"],
                             "step": tree["step"], "skipped": tree["skipped"]})
        try:
            self.loader.load_state_dict(loader_state, check_tokens=not r.allow_config_change)
        except ValueError as exc:     # other data than the checkpoint's: resuming would mix them
            raise ConfigError(f"resuming from {load_dir}: {exc}. Restore the data, start a new run (another "
                              f"output_dir), or pass --allow-config-change to continue on these tokens") from exc
        if self.sampler is not None:       # the checkpoint's generation key: the same samples follow
            self.sampler.key = self.loader.generation_key
        try:
            ck.set_rng_state(lead_value(lambda: ck.load_checkpoint(load_dir, step=latest, keys=["rng"]).tree["rng"]))
        except ck.CheckpointMismatchError:   # saved from another world size: keep ours
            pass

    # ------------------------------------------------------------------ eval
    @property
    def has_val(self) -> bool:
        return self.job.data.val is not None

    def evaluate(self, done: int) -> tuple[float, dict]:
        """The held-out loss after ``done`` steps, and the other evaluation metrics: preference
        pairs' rewards / margins / accuracies / log-probabilities (TRL's ``eval_rewards/...``),
        GRPO's (its held-out prompts sampled with the current parameters and scored)."""
        from functional_pp.app.evaluate import evaluate_metrics
        r = self.job
        if r.grpo is not None:
            found = self.sampler.evaluate(r.step_fn, r.whole_params(self.state["params"]), r.data.val,
                                          r.eval_per_batch, done, self.shard)
            return found["eval_loss"], found
        found = evaluate_metrics(r.step_fn, r.whole(self.state), self.val_loader)
        if self.perplexity_loaders:         # do_causal_lm_eval: Axolotl's eval_perplexity
            from functional_pp.app.evaluate import perplexity
            found["eval_perplexity"] = perplexity(r.step_fn, r.whole(self.state), self.perplexity_loaders)
        return found.pop("eval_loss"), found

    def first_eval(self) -> None:
        """A fresh run's evaluation before its first step (logged as step 0)."""
        if self.has_val and self.start == 0:
            e0, extra = self.evaluate(0)
            if self.lead:
                self.job.loggers.log(0, {**extra, "eval_loss": e0})
                self.progress.eval_loss = e0

    def read_and_log(self, with_eval: bool = False) -> None:
        """Read the unread steps' metrics (one transfer: the step's host checks raise here,
        naming the first failing step, once the steps before it are logged), evaluate if asked
        and log them (docs/eager_overhead.md "Host synchronisation")."""
        r = self.job
        error = None
        try:
            r.step_fn.read()
        except Exception as exc:   # noqa: BLE001 (re-raised below)
            error = exc
        eval_loss, eval_extra = self.evaluate(self.step) if with_eval and error is None else (None, {})
        self.improved = False
        if r.cfg.checkpoint.save_best and eval_loss is not None and (
                self.best_eval is None or (eval_loss > self.best_eval if r.cfg.greater_is_better
                                           else eval_loss < self.best_eval)):
            self.best_eval, self.improved = eval_loss, True
        unread, watch, halted = self.unread, self.watch, self.halted
        for i, (s, m, elapsed) in enumerate(unread):
            if getattr(m, "error", None) is not None:
                break                    # the failing step and those after it
            m = {**dict(m), **self.rollout_metrics.pop(s, {})}
            self.losses.append(m["loss"])
            self.skipped_steps += int(bool(m.get("skipped", 0)))
            self.untrained_steps += int(m.get("tokens", 1) == 0 and not m.get("skipped", 0))   # every label ignored
            why = watch.loss(s, m["loss"])
            if why is None and eval_loss is not None and i == len(unread) - 1:
                why = watch.eval_loss(s, eval_loss)
            if why is not None and not halted:
                halted.append(why)
            if eval_loss is not None and i == len(unread) - 1:
                m.update(eval_extra)
                m["eval_loss"] = eval_loss
            if self.lead:
                m["elapsed_s"] = elapsed
                if r.latest is not None and s == self.start + 1:
                    m["resumed_from"] = self.start
                r.loggers.log(s, m)
                self.progress.update(s, m)
        unread.clear()
        if error is not None:
            raise error

    # ------------------------------------------------------------------ the step loop
    def next_batch(self) -> dict:
        """The next step's batch on the device (GRPO: sampled with the current parameters,
        scored, this device's rows)."""
        from functional_pp.data.loader import to_device
        if self.sampler is not None:
            batch, self.rollout_metrics[self.step + 1] = self.sampler.step_batch(
                self.job.step_fn, self.job.whole_params(self.state["params"]), self.loader, self.step, self.shard)
        else:
            batch = next(self.loader)
        return to_device(batch, self.job.device)        # pinned + non-blocking on CUDA

    def train_step(self, batch: dict) -> Mapping:
        """One step; the first one's communication written to the report (lead)."""
        from functional_pp.core import comm
        r = self.job
        if self.lead and self.report_text is None:
            with comm.comm_report() as rep:
                self.state, m = r.step_fn(self.state, batch)
            self.report_text = comm_report_text(rep, self.step + 1, r.mesh, r.cfg)
            (r.out_dir / COMM_REPORT).write_text(self.report_text + "\n")
            self.progress.message(self.report_text)
            return m
        self.state, m = r.step_fn(self.state, batch)
        return m

    def step_loop(self) -> None:
        """Steps until ``max_steps``, an agreed stop (a signal, ``stop_after``) or a stopping
        rule; metrics read every ``log_every`` steps, evaluations every ``eval_every``,
        checkpoints every ``save_every``."""
        r = self.job
        cfg, stop, stop_after = r.cfg, r.stop, r.stop_after
        self.last_saved = self.step = self.start
        t0 = time.perf_counter()
        qat_after = (cfg.qat or {}).get("fake_quant_after_n_steps")
        while self.step < cfg.max_steps:
            asked = stop.event.is_set() or (stop_after is not None and self.step >= stop_after)
            if agree_to_stop(asked):
                self.stopped = True
                break
            batch = self.next_batch()
            if qat_after is not None:                # qat.fake_quant_after_n_steps: off until then
                fake_quant.set_enabled(self.step >= qat_after)
            dropout_seeds.begin_step(self.step)      # (dropout masks of this step: the same after a resume)
            m = self.train_step(batch)
            self.step += 1
            step = self.step
            if r.grpo is not None and r.grpo.sync_ref_model and step % r.grpo.ref_model_sync_steps == 0:
                from functional_pp.app.preference_run import sync_reference
                sync_reference(self.state["params"], r.grpo.ref_model_mixup_alpha)     # TR-DPO (TRL's callback)
            self.unread.append((step, m, time.perf_counter() - t0))
            with_eval = self.has_val and (step % r.eval_every == 0 or step == cfg.max_steps)
            save_now = bool(cfg.checkpoint.save_every) and step % cfg.checkpoint.save_every == 0
            # read every log_every steps, after the first one, and before an evaluation or a
            # checkpoint: no checkpoint holds a state past an unreported error
            if with_eval or save_now or step % cfg.logging.log_every == 0 or step == self.start + 1:
                self.read_and_log(with_eval)
                save_now = save_now or (with_eval and self.improved)      # save_strategy: best
            if save_now:
                self.save()
            if self.watch.threshold is not None and not self.halted:
                self.read_and_log(False)                  # the watchdog sees every step's loss
            if self.halted:
                break

    # ------------------------------------------------------------------ save
    def save(self) -> None:
        """A checkpoint of the current state on every device (app/host_view.py)."""
        step = self.step
        self.saved_path = save_on_devices(lambda s: self.job.save(s, self.loader, step), self.state)
        self.last_saved = step
        if self.lead:
            self.progress.message(f"saved checkpoint {self.saved_path}")

    # ------------------------------------------------------------------ finish (device)
    def finish(self) -> None:
        """The last metrics read, the final checkpoint (at the end, on a stop or a stopping rule),
        the stop's message."""
        r = self.job
        self.read_and_log()
        final = self.stopped or bool(self.halted) or r.cfg.checkpoint.save_final
        if final and self.step != self.last_saved:
            self.save()
        if self.lead and self.stopped:
            stop, stop_after = r.stop, r.stop_after
            why = (f"received {stop.signal}" if stop.signal else "asked to stop"
                   + (f" after step {stop_after}" if stop_after is not None else ""))
            self.progress.message(f"{why}: stopped at step {self.step} with checkpoint "
                                  f"{r.manager.path(self.step)}; continue with --resume")


def _build_step(cfg: TrainConfig, mesh, rules, family, model_cfg, loss, opt, copies: tuple[str, ...] = (),
                **options):
    """The training step: :func:`~functional_pp.step.train.train_step`, or with a ``pp`` axis
    :func:`~functional_pp.step.pipeline.pipeline_step` (the config's schedule and virtual
    stages, the family's first- and last-stage parameters); ``copies``: keys of whole copies of
    the model in the tree (a preference run's frozen reference), split over the stages alike."""
    from functional_pp.app.pipeline_parts import pipeline_parts
    from functional_pp.step.pipeline import FewMicroBatchesWarning, pipeline_step
    from functional_pp.step.train import train_step
    if "pp" not in mesh.shape:
        return train_step(loss, opt, mesh=mesh, rules=rules, **options)
    layers, first, last = pipeline_parts(family, model_cfg, copies)
    try:
        with warnings.catch_warnings():     # the config check already warned (config/checks.py)
            warnings.simplefilter("ignore", FewMicroBatchesWarning)
            return pipeline_step(loss, opt, mesh=mesh, rules=rules, schedule=cfg.pp_schedule,
                                 virtual_stages=cfg.pp_virtual_stages, layers=layers, first_stage=first,
                                 last_stage=last,
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


