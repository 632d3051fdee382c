"""The memory of an online run's rollout (docs/memory.md "Rollouts"): before each step GRPO and
EBFT sample with the training state alive, and the sampling holds a key / value cache of the
sampled batch. Its size comes from the generation memory model (plan/generation.py, that of
``generate --memory``) run on the run's own policy under the run's sampling rules; the rollout's
peak is the state the step also holds (weights, optimizer state) plus the trained weights' copy
in the compute dtype the sampling reads (``step.named_params``: none under fp32), that cache and
one forward's temporaries; a run's peak is the larger of the rollout's and the step's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from functional_pp.config import TrainConfig, model_family

__all__ = ["RolloutShape", "RolloutEstimate", "rollout_shape", "estimate_rollout", "hold_rollout"]

#: the step's categories a rollout holds too (gradients and activations are the step's own)
HELD = ("weights", "optimizer state")


@dataclass(frozen=True)
class RolloutShape:
    """The largest generate call of a step's rollout: ``rows`` sampled together, each a prompt of
    at most ``prompt`` positions and ``new_tokens`` sampled after it."""
    rows: int
    prompt: int
    new_tokens: int


@dataclass(frozen=True)
class RolloutEstimate:
    """One device's rollout: ``generation`` (a :class:`~functional_pp.plan.generation.GenerationEstimate`
    of its largest generate call) and ``cast_bytes``, the compute-dtype copy of the trained weights'
    shards that the sampling reads while the fp32 masters stay (0 under fp32)."""
    generation: Any
    cast_bytes: int

    @property
    def batch(self) -> int:
        return self.generation.batch

    @property
    def prompt(self) -> int:
        return self.generation.prompt

    @property
    def new_tokens(self) -> int:
        return self.generation.new_tokens

    @property
    def cache_bytes(self) -> int:
        return self.generation.cache_bytes

    @property
    def forward_bytes(self) -> int:
        return self.generation.forward_bytes

    @property
    def added_bytes(self) -> int:
        """What the rollout holds beyond the step's held state: the copy, the cache, one forward."""
        return self.cast_bytes + self.cache_bytes + self.forward_bytes


def rollout_shape(cfg: TrainConfig, global_batch: int) -> RolloutShape | None:
    """GRPO: the step's completions (prompts x ``num_generations``, the global batch) of prompts
    up to ``sequence_len - max_completion_length`` (one left-padded call); EBFT: the step's
    documents x ``n_samples_per_prompt`` at the last anchor (the cache each of its calls is
    bounded to: :func:`~functional_pp.preference.ebft_rollout.call_tokens`). None for a run
    without a rollout."""
    from functional_pp.app import ebft_run, grpo_run
    if grpo_run.is_grpo(cfg):
        new = grpo_run.grpo_settings(cfg).max_completion_length
        return RolloutShape(global_batch, max(1, cfg.sequence_len - new), new)
    if ebft_run.is_ebft(cfg):
        from functional_pp.preference.ebft import strided_anchors
        spec = ebft_run.ebft_settings(cfg)
        anchors = strided_anchors(cfg.sequence_len, stride=spec.stride, context_length=spec.context_length,
                                  generate_max_len=spec.generate_max_len)
        return RolloutShape(global_batch * spec.n_samples_per_prompt, max(anchors, default=spec.context_length),
                            spec.generate_max_len)
    return None


def estimate_rollout(cfg: TrainConfig, mesh: Any, rules: Any, model_cfg: Any, global_batch: int,
                     dtype: Any) -> RolloutEstimate | None:
    """One device's rollout (:class:`RolloutEstimate`) under ``mesh`` and the run's sampling rules
    (the sequence whole), the weights in the compute ``dtype``; None for a run without one."""
    from functional_pp.app import ebft_run, grpo_run
    from functional_pp.plan.generation import estimate_generation
    shape = rollout_shape(cfg, global_batch)
    if shape is None:
        return None
    family = model_family(cfg)
    base = family.param_decls(model_cfg, dtype)
    if grpo_run.is_grpo(cfg):
        _, decls, trainable, policy = grpo_run.grpo_objective_of(cfg, grpo_run.grpo_settings(cfg), family,
                                                                 model_cfg, cfg.lora_config(), base)
    else:
        _, decls, trainable, policy, _ = ebft_run.ebft_objective_of(cfg, ebft_run.ebft_settings(cfg), family,
                                                                    model_cfg, cfg.lora_config(), base)
    gen = estimate_generation(policy, decls, mesh, grpo_run._sampling_rules(rules), batch=shape.rows,
                              prompt=shape.prompt, new_tokens=shape.new_tokens)
    return RolloutEstimate(gen, _cast_bytes(decls, trainable, mesh, rules, dtype))


def _cast_bytes(decls: Any, trainable: Any, mesh: Any, rules: Any, dtype: Any) -> int:
    """This device's bytes of the trained parameters cast to the compute ``dtype`` (none under
    fp32: the sampling reads the masters)."""
    import torch

    from functional_pp.core.layout import local_shape
    from functional_pp.core.tree import leaves_with_paths
    if dtype == torch.float32:
        return 0
    flags = dict(leaves_with_paths(trainable(decls))) if trainable is not None else {}
    return sum(torch.Size(local_shape(d.shape, rules.resolve(d.dims, d.shape, mesh, name=p), mesh)).numel()
               * dtype.itemsize for p, d in leaves_with_paths(decls)
               if flags.get(p, True) and d.dtype.is_floating_point)


def hold_rollout(est: Any, gen: RolloutEstimate) -> None:
    """Amend a step's :class:`~functional_pp.plan.dryrun.LayoutEstimate` with its rollout ``gen``
    (``est.rollout``): the estimate's peak becomes the larger of the step's and the rollout's (the
    step's held state + :attr:`RolloutEstimate.added_bytes`), its split the rollout's when that is
    larger."""
    held = sum(est.memory.get(c, 0) for c in HELD)
    rollout = held + gen.added_bytes
    est.notes.append(f"rollout: compute copy {gen.cast_bytes} B + key / value cache {gen.cache_bytes} B + forward "
                     f"{gen.forward_bytes} B over the held state ({gen.batch} rows x ({gen.prompt} + "
                     f"{gen.new_tokens}) positions)")
    est.rollout = gen
    if rollout > est.peak_bytes:
        est.memory = {**{c: est.memory.get(c, 0) for c in HELD}, "compute copy": gen.cast_bytes,
                      "key / value cache": gen.cache_bytes, "generation forward": gen.forward_bytes}
        est.peak_bytes = rollout
