"""What ``rl: grpo`` (and ``gdpo``) changes in a run (docs/preference.md "GRPO"): the settings
of the ``trl:`` section, the prompts, the reward functions, the objective
(:func:`~functional_pp.preference.grpo.grpo_objective`, the reference as for DPO when
``trl.beta`` > 0) and, before each step, the rollout: every device samples the step's
completions with the policy's current parameters (in-process, under the run's layout), scores
them, normalises the advantages and takes its block of the batch. Used by
:mod:`functional_pp.app.loop`."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from functional_pp.config import ConfigError, TrainConfig

__all__ = ["GRPO_METHODS", "is_grpo", "grpo_settings", "grpo_objective_of", "load_prompts", "reward_functions",
           "prompts_per_step", "eval_prompts_per_batch", "steps_per_epoch", "summary_line", "prompt_steps",
           "old_logps", "GRPOSampler"]

#: ``rl:`` methods trained by the online loop (gdpo: TRL's ``normalize_then_sum``)
GRPO_METHODS = ("grpo", "gdpo")


def is_grpo(cfg: TrainConfig) -> bool:
    return cfg.rl is not None and str(cfg.rl).lower() in GRPO_METHODS


def grpo_settings(cfg: TrainConfig):
    """The run's :class:`~functional_pp.preference.grpo_spec.GRPOSpec`."""
    from functional_pp.preference.grpo_spec import grpo_spec
    try:
        return grpo_spec(cfg.rl, cfg.trl, cfg.vllm)
    except ValueError as exc:
        raise ConfigError(f"rl: {cfg.rl}: {exc}") from exc


def grpo_objective_of(cfg: TrainConfig, spec: Any, family: Any, model_cfg: Any, lora: Any, base_decls: Any) -> tuple:
    """``(loss, declarations, trainable mask, policy)`` of a GRPO run."""
    from functional_pp.app.preference_run import policy_and_reference
    from functional_pp.preference.grpo import grpo_objective
    policy, reference, decls, trainable = policy_and_reference(cfg, spec.needs_reference, family, model_cfg, lora,
                                                               base_decls)
    loss = grpo_objective(policy, loss_type=spec.loss_type, beta=spec.beta, epsilon=spec.epsilon,
                          epsilon_high=spec.epsilon_high, delta=spec.delta,
                          max_completion_length=spec.max_completion_length, reference=reference,
                          importance_sampling_level=spec.importance_sampling_level)
    return loss, decls, trainable, policy


def _config_dir(cfg: TrainConfig) -> Path | None:
    source = getattr(cfg, "source_path", None)
    return Path(source).parent if source else None


def load_prompts(cfg: TrainConfig, spec: Any):
    """The run's :class:`~functional_pp.app.inputs.RunData` of prompts, ``val_set_size`` of them
    held out (chosen by the seed) for evaluation."""
    from functional_pp.app.inputs import RunData, load_tokenizer
    from functional_pp.data.formats import ByteTokenizer
    from functional_pp.data.prompts import build_prompts
    tok = load_tokenizer(cfg) or ByteTokenizer()
    try:
        prompts = build_prompts(cfg.datasets, tok, seq_len=cfg.sequence_len,
                                max_completion_length=spec.max_completion_length, chat_template=cfg.chat_template,
                                chat_template_jinja=cfg.chat_template_jinja, cfg=cfg.to_dict(),
                                config_dir=_config_dir(cfg))
    except (FileNotFoundError, ValueError, ImportError) as exc:
        raise ConfigError(f"datasets: {exc}") from exc
    if not cfg.val_set_size:
        return RunData(prompts, None, tok)
    from functional_pp.data.formats import split_held_out
    try:
        train, val = split_held_out(prompts, cfg.val_set_size, cfg.seed, "prompts")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return RunData(train, val, tok)


def reward_functions(cfg: TrainConfig, spec: Any) -> list[tuple[str, Callable]]:
    """``(name, function)`` of each ``trl.reward_funcs`` entry, imported (as Axolotl does) from the
    config's directory, the working directory or ``sys.path``; each must take at least two
    arguments (``prompts``, ``completions``)."""
    from functional_pp.data.prompts import import_dotted
    out = []
    for i, name in enumerate(spec.reward_funcs):
        try:
            fn = import_dotted(name, "a reward function f(prompts, completions, **kwargs) -> list[float]",
                               f"trl.reward_funcs[{i}]", (_config_dir(cfg),))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        params = inspect.signature(fn).parameters.values()
        if sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params) < 2 and not any(
                p.kind is p.VAR_KEYWORD for p in params):
            raise ConfigError(f"trl.reward_funcs[{i}]: {name} must accept at least two arguments (prompts, "
                              f"completions; TRL's signature f(prompts, completions, **kwargs))")
        out.append((name.rpartition(".")[2], fn))
    return out


def prompts_per_step(global_batch: int, spec: Any, prompts: Any) -> int:
    """The prompts a step samples from: the global batch (completions, TRL's
    ``per_device_train_batch_size`` x processes x accumulation) over ``num_generations``."""
    if global_batch % spec.num_generations:
        raise ConfigError(f"rl: grpo: the global batch of {global_batch} completions (micro_batch_size x "
                          f"gradient_accumulation_steps x data-parallel size) is not a multiple of "
                          f"trl.num_generations {spec.num_generations}; change one of them")
    n = global_batch // spec.num_generations
    if len(prompts) < n:
        raise ConfigError(f"datasets: {len(prompts)} prompts are fewer than one step's {n} (the global batch "
                          f"{global_batch} / num_generations {spec.num_generations}); add prompts or lower the batch")
    return n


def eval_prompts_per_batch(global_batch: int, spec: Any, val: Any) -> int:
    """The held-out prompts of one evaluation batch: the global batch (completions) over
    ``num_generations_eval``; the held-out prompts must fill one."""
    g = spec.eval_generations
    if global_batch % g:
        raise ConfigError(f"rl: grpo: the global batch of {global_batch} completions is not a multiple of "
                          f"trl.num_generations_eval {g}; change one of them")
    n = global_batch // g
    if len(val) < n:
        raise ConfigError(f"val_set_size: {len(val)} held-out prompts are fewer than one evaluation batch's {n} (the "
                          f"global batch {global_batch} / num_generations_eval {g}); hold out more prompts")
    return n


def steps_per_epoch(prompts: Any, per_step: int, spec: Any) -> int:
    """Training steps per pass over the prompts: each generation trains ``num_iterations`` steps."""
    return max(1, len(prompts) // per_step) * spec.num_iterations


def summary_line(spec: Any, per_step: int, val: Any = None, eval_per_batch: int = 0) -> str:
    """The start-up summary's GRPO line (and its evaluation's)."""
    engine = (f"; {', '.join(spec.engine_keys)} not used: generation runs in-process with the policy's weights"
              if spec.engine_keys else "; generation runs in-process with the policy's weights")
    names = ", ".join(spec.reward_funcs)
    weights = f" (weights {list(spec.weights())})" if spec.reward_weights is not None else ""
    return (f"grpo:       {per_step} prompts x {spec.num_generations} generations per step, max_completion_length "
            f"{spec.max_completion_length}, temperature {spec.temperature:g}, top_p {spec.top_p:g}, top_k "
            f"{spec.top_k}; rewards {names}{weights}; loss {spec.loss_type}, beta {spec.beta:g}, epsilon "
            f"{spec.epsilon:g}, scale_rewards {spec.scale_rewards}"
            + (f", {spec.num_iterations} updates per generation" if spec.num_iterations > 1 else "")
            + (f", {spec.multi_objective_aggregation}" if spec.multi_objective_aggregation != "sum_then_normalize"
               else "") + (f", importance sampling per sequence (GSPO)" if spec.importance_sampling_level == "sequence"
                           else "") + engine + (_eval_line(spec, val, eval_per_batch) if val is not None else ""))


def _eval_line(spec: Any, val: Any, per_batch: int) -> str:
    batches = len(val) // per_batch
    left = len(val) - batches * per_batch
    return (f"\ngrpo eval:  {batches * per_batch} held-out prompts x {spec.eval_generations} generations in {batches} "
            f"batch(es) of {per_batch}" + (f" ({left} left out: not a whole batch)" if left else ""))


def prompt_steps(prompts: Any, per_step: int, seed: int):
    """The loop's loader of a GRPO run: each step's prompts (every device the same)."""
    from functional_pp.data.prompts import PromptLoader
    return PromptLoader(prompts, prompts_per_step=per_step, seed=seed)


_DTYPES = {"tokens": torch.long, "labels": torch.long}


def _reward_kwargs(step: int, max_steps: int, logged: dict) -> dict:
    """What TRL passes every reward function besides the columns: ``trainer_state`` (its
    ``global_step`` (steps done) and ``max_steps``), ``log_metric(name, value)`` (the step's
    metrics get each name's mean) and ``log_extra`` (TRL's completions table: not kept here)."""
    from types import SimpleNamespace

    def log_metric(name: str, value: float) -> None:
        logged.setdefault(str(name), []).append(float(value))
    return {"trainer_state": SimpleNamespace(global_step=step, max_steps=max_steps),
            "log_metric": log_metric, "log_extra": lambda *a, **k: None}


def _sampling_rules(rules: Any) -> Any:
    """The run's rules for sampling: the sequence and the residual stream's sequence whole (one
    new token per row cannot be split over cp, nor over tp as ``sequence_parallel`` splits the
    residual): under cp every device of a cp group computes the whole sequences of its rows
    (the parameters gathered as for the step); the training step splits them as usual."""
    return rules.replace(seq=(), res_seq=())


def old_logps(policy: Callable, named_params: Any, tokens: Any, labels: Any) -> torch.Tensor:
    """GRPO's ``old_logps`` pass (``num_iterations`` > 1): the policy's per-token log-probabilities
    of ``labels`` after ``tokens`` (both ``batch seq``, laid out by the sampling rules), without
    gradients, gathered whole on this device (``[N, seq_len]``). The rollout's estimate runs it
    on meta tensors (app/rollout_memory.py)."""
    from functional_pp import ops
    from functional_pp.parallel.fsdp.regather import relayout
    with torch.no_grad():
        lp = ops.token_log_probs(policy(named_params, tokens), labels)
        full = relayout(lp, tuple(() for _ in lp.dims), "grpo old logps").value()
    return full.permute(lp.dims.index("batch"), lp.dims.index("seq"))


@dataclass
class GRPOSampler:
    """Turns a step's prompts into this device's GRPO batch (the module docstring)."""

    spec: Any
    policy: Callable                  # policy(params, tokens) -> logits
    tokenizer: Any
    reward_funcs: list
    seq_len: int
    pad_id: int
    stop_ids: list[int]
    key: int                          # the generation key (checkpointed with the loader)
    max_steps: int = 0
    chunk_rows: int | None = None     # TRL's per_device_train_batch_size (micro_batch_size): bnpo's micro-batches

    def step_batch(self, step_fn: Any, params: Any, loader: Any, step: int, shard: Any) -> tuple[dict, dict]:
        """``(this device's batch, the generation's metrics)`` of step ``step`` (0-based). Every
        ``num_iterations``-th step samples a new generation from the loader's next prompts with
        ``params`` (the training state's) as the step's loss sees them (``step_fn``'s rules,
        compute precision and policy); the steps between reuse it with the sampling policy's
        log-probabilities (``old_logps``), kept in ``loader.carry`` (so in checkpoints)."""
        n = self.spec.num_iterations
        if step % n == 0 or loader.carry is None:
            whole, metrics = self._generate(step_fn, params, next(loader), step, shard)
            if n > 1:
                loader.carry = {k: v.tolist() for k, v in whole.items()}
        else:
            metrics = {}
        if n > 1:
            whole = {k: torch.tensor(v, dtype=_DTYPES.get(k, torch.float32)) for k, v in loader.carry.items()}
            if (step + 1) % n == 0:                     # the generation's last update
                loader.carry = None
        return {k: v.contiguous() for k, v in shard.cut(whole).items()}, metrics

    def _generate(self, step_fn: Any, params: Any, prompts: list, step: int, shard: Any) -> tuple[dict, dict]:
        """The global batch of a new generation (with ``old_logps`` when ``num_iterations`` > 1)
        and its metrics."""
        from functional_pp.parallel.shard_map import use_rules
        from functional_pp.preference.rollout import rollout, rollout_batch, rollout_metrics
        with use_rules(_sampling_rules(step_fn.rules)), step_fn.apply_policy():
            named_params = step_fn.named_params(params)
            logged: dict[str, list[float]] = {}
            r = rollout(self.policy, named_params, prompts, self.spec, self.tokenizer, self.reward_funcs,
                        stop_ids=self.stop_ids, pad_id=self.pad_id, key=self.key, step=step,
                        row_multiple=shard.dp_size, reward_kwargs=_reward_kwargs(step, self.max_steps, logged))
            whole = rollout_batch(r, self.seq_len, self.pad_id, self.spec.mask_truncated_completions,
                                  self.chunk_rows)
            if self.spec.num_iterations > 1:
                whole["old_logps"] = self._logps(named_params, whole)
        return whole, {**rollout_metrics(r), **{k: sum(v) / len(v) for k, v in logged.items()}}

    def _logps(self, named_params: Any, whole: dict) -> torch.Tensor:
        """The policy's per-token log-probabilities of the labels, ``[N, seq_len]`` (fp32, CPU)."""
        from functional_pp.parallel.reshard import named
        from functional_pp.preference.rollout import params_device
        device = params_device(named_params)
        return old_logps(self.policy, named_params, named(whole["tokens"].to(device), "batch seq"),
                         named(whole["labels"].to(device), "batch seq")).float().cpu()

    def evaluate(self, step_fn: Any, params: Any, val: Any, per_batch: int, step: int, shard: Any) -> dict:
        """TRL's evaluation of the held-out prompts ``val`` at step ``step`` (steps done): each
        batch of ``per_batch`` prompts (in order; a last partial batch left out) sampled with
        ``num_generations_eval`` completions each from ``params`` (seeds apart from training's),
        scored, and its loss computed without gradients; ``eval_loss`` and TRL's generation
        metrics and the loss's (``kl``, ``clip_ratio_*``), prefixed ``eval_``, each the mean over
        the batches (as TRL logs them)."""
        import dataclasses

        from functional_pp.core import step_values
        from functional_pp.parallel.named import settle, wrap
        from functional_pp.parallel.shard_map import use_rules
        from functional_pp.preference.rollout import params_device, rollout, rollout_batch, rollout_metrics
        spec = dataclasses.replace(self.spec, num_generations=self.spec.eval_generations)
        sums: dict[str, float] = {}
        batches = len(val) // per_batch
        for i in range(batches):
            prompts = val.prompts[i * per_batch:(i + 1) * per_batch]
            logged: dict[str, list[float]] = {}
            with torch.no_grad(), use_rules(_sampling_rules(step_fn.rules)), step_fn.apply_policy():
                r = rollout(self.policy, step_fn.named_params(params), prompts, spec, self.tokenizer,
                            self.reward_funcs, stop_ids=self.stop_ids, pad_id=self.pad_id, key=self.key, step=step,
                            row_multiple=shard.dp_size, reward_kwargs=_reward_kwargs(step, self.max_steps, logged),
                            stream=1 + i)
            whole = rollout_batch(r, self.seq_len, self.pad_id, spec.mask_truncated_completions, self.chunk_rows)
            local = shard.cut(whole)
            with torch.no_grad(), use_rules(step_fn.rules), step_fn.apply_policy():
                named_params = step_fn.named_params(params)
                device = params_device(named_params)
                nb = {k: wrap(v.contiguous().to(device), step_fn.batch_dims[k]) for k, v in local.items()}
                with step_values.collecting() as found:
                    loss = float(settle(step_fn.loss_fn(named_params, nb)).data)
            metrics = {"loss": loss, **rollout_metrics(r), **{k: float(v) for k, (v, _) in found.items()},
                       **{k: sum(v) / len(v) for k, v in logged.items()}}
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v / batches
        return {f"eval_{k}": v for k, v in sums.items()}

    @staticmethod
    def stops_of(tokenizer: Any) -> list[int]:
        """The tokens ending a completion: the tokenizer's EOS and its chat end-of-turn token."""
        ids = [getattr(tokenizer, "eos_id", None), getattr(tokenizer, "chat_eos_id", None)]
        return [int(i) for n, i in enumerate(ids) if i is not None and i not in ids[:n]]
