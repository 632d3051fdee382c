"""The memory of an online run's rollout (docs/memory.md "Rollouts"): before each step GRPO and
EBFT sample with the training state alive, and the sampling holds a key / value cache of the
sampled batch. Its size comes from the generation memory model (plan/generation.py, that of
``generate --memory``, an eager ``generate``'s) run on the run's own policy under the run's
sampling rules; after sampling, a no-grad scoring forward of the whole batch may follow (GRPO's
``old_logps`` pass with ``num_iterations`` > 1, EBFT's feature model over the block-parallel
rows), run on meta tensors by the same dry run through the run's own code (``grpo_run.old_logps``,
``ebft_run.feature_pass``). The rollout's peak is the state the step also holds (weights,
optimizer state) plus, under a pipeline, the whole model gathered over ``pp`` (every device
samples with all the layers: their cache is every layer's too), the trained weights' copy in
the compute dtype the sampling reads (``step.named_params``: none under fp32) and the larger of the sampling's cache and forward and
the scoring forward's temporaries; a run's peak is the larger of the rollout's and the step's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from functional_pp.config import TrainConfig, model_family

__all__ = ["RolloutShape", "RolloutEstimate", "rollout_shape", "estimate_rollout", "hold_rollout", "sets_peak"]

#: the step's categories a rollout holds too (gradients and activations are the step's own)
HELD = ("weights", "optimizer state")
#: the categories of a rollout's peak beyond them: the sampling's, or the scoring forward's
SAMPLING = ("compute copy", "key / value cache", "generation forward")
SCORING = ("compute copy", "scoring forward")


@dataclass(frozen=True)
class RolloutShape:
    """The largest generate call of a step's rollout: ``rows`` sampled together, each a prompt of
    at most ``prompt`` positions and ``new_tokens`` sampled after it; ``scored``: the rows and
    positions of the scoring forward after it (None: none), ``scoring`` what that forward is."""
    rows: int
    prompt: int
    new_tokens: int
    scored: tuple[int, int] | None = None
    scoring: str = ""


@dataclass(frozen=True)
class RolloutEstimate:
    """One device's rollout: ``generation`` (a :class:`~functional_pp.plan.generation.GenerationEstimate`
    of its largest generate call), ``cast_bytes``, the compute-dtype copy of the trained weights'
    shards that the sampling reads while the fp32 masters stay (0 under fp32), and ``scoring``
    (a :class:`~functional_pp.plan.generation.ForwardEstimate` of the scoring forward after the
    sampling, ``shape.scoring`` says which; None: none); ``gathered_bytes``: under a pipeline the
    whole model gathered over ``pp`` on every stage (``logical_params``: each stage-held
    parameter's copy in its master dtype, beside the stage's own), which the sampling reads."""
    generation: Any
    cast_bytes: int
    scoring: Any = None
    shape: RolloutShape | None = None
    gathered_bytes: int = 0

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
    def sampling_bytes(self) -> int:
        """The sampling's peak beyond the weights: its cache and forward."""
        return self.cache_bytes + self.forward_bytes

    @property
    def scoring_bytes(self) -> int:
        """The scoring forward's peak beyond the weights (0: none; the cache is freed by then)."""
        return self.scoring.forward_bytes if self.scoring is not None else 0

    @property
    def added_bytes(self) -> int:
        """What the rollout holds beyond the step's held state: the copy and the larger of the
        sampling's and the scoring forward's."""
        return self.gathered_bytes + self.cast_bytes + max(self.sampling_bytes, self.scoring_bytes)

    def split(self) -> dict[str, int]:
        """:attr:`added_bytes` by category (:data:`SAMPLING` or :data:`SCORING`)."""
        gathered = {"gathered model": self.gathered_bytes} if self.gathered_bytes else {}
        if self.scoring_bytes > self.sampling_bytes:
            return {**gathered, **dict(zip(SCORING, (self.cast_bytes, self.scoring_bytes)))}
        return {**gathered, **dict(zip(SAMPLING, (self.cast_bytes, self.cache_bytes, self.forward_bytes)))}


def rollout_shape(cfg: TrainConfig, global_batch: int) -> RolloutShape | None:
    """GRPO: the step's completions (prompts x ``num_generations``, the global batch) of prompts
    up to ``sequence_len - max_completion_length`` (one left-padded call); EBFT: the step's
    documents x ``n_samples_per_prompt`` at the last anchor (the cache each of its calls is
    bounded to: :func:`~functional_pp.preference.ebft_rollout.call_tokens`). None for a run
    without a rollout."""
    from functional_pp.app import ebft_run, grpo_run
    if grpo_run.is_grpo(cfg):
        spec = grpo_run.grpo_settings(cfg)
        new = spec.max_completion_length
        scored = (global_batch, cfg.sequence_len) if spec.num_iterations > 1 else None
        return RolloutShape(global_batch, max(1, cfg.sequence_len - new), new, scored, "old_logps forward")
    if ebft_run.is_ebft(cfg):
        from functional_pp.preference.ebft import strided_anchors
        from functional_pp.preference.ebft_rollout import row_length_of
        spec = ebft_run.ebft_settings(cfg)
        anchors = strided_anchors(cfg.sequence_len, stride=spec.stride, context_length=spec.context_length,
                                  generate_max_len=spec.generate_max_len)
        return RolloutShape(global_batch * spec.n_samples_per_prompt, max(anchors, default=spec.context_length),
                            spec.generate_max_len, (global_batch, row_length_of(spec, cfg.sequence_len)),
                            "feature-model forward")
    return None


def estimate_rollout(cfg: TrainConfig, mesh: Any, rules: Any, model_cfg: Any, global_batch: int,
                     dtype: Any) -> RolloutEstimate | None:
    """One device's rollout (:class:`RolloutEstimate`) under ``mesh`` and the run's sampling rules
    (the sequence whole), the weights in the compute ``dtype``; None for a run without one."""
    from functional_pp.app import ebft_run, grpo_run
    from functional_pp.plan.generation import estimate_forward, estimate_generation
    shape = rollout_shape(cfg, global_batch)
    if shape is None:
        return None
    family = model_family(cfg)
    base = family.param_decls(model_cfg, dtype)
    if grpo_run.is_grpo(cfg):
        _, decls, trainable, policy = grpo_run.grpo_objective_of(cfg, grpo_run.grpo_settings(cfg), family,
                                                                 model_cfg, cfg.lora_config(), base)

        def scoring(params, rows):
            return grpo_run.old_logps(policy, params, rows["tokens"], rows["labels"])
        columns = ("tokens", "labels")
    else:
        _, decls, trainable, policy, features = ebft_run.ebft_objective_of(
            cfg, ebft_run.ebft_settings(cfg), family, model_cfg, cfg.lora_config(), base)

        def scoring(params, rows):     # (each layer's float32 copy is made, then goes to the host)
            return ebft_run.feature_pass(features, params, rows, lambda h: tuple(h.float().shape))
        columns = ("tokens", "segments", "position_ids", "prefix")
    sampling = grpo_run._sampling_rules(rules)
    gen = estimate_generation(policy, decls, mesh, sampling, batch=shape.rows, prompt=shape.prompt,
                              new_tokens=shape.new_tokens, compiled=False)
    scored = None
    if shape.scored is not None:
        scored = estimate_forward(scoring, decls, mesh, sampling, {c: (shape.scored, "batch seq") for c in columns})
    return RolloutEstimate(gen, _cast_bytes(decls, trainable, mesh, rules, dtype), scored, shape,
                           _gathered_bytes(decls, trainable, mesh, rules, family, model_cfg))


def _gathered_bytes(decls: Any, trainable: Any, mesh: Any, rules: Any, family: Any, model_cfg: Any) -> int:
    """Under a pipeline (pp > 1): this device's bytes of the whole model gathered over ``pp`` for
    the sampling (``TrainStep.logical_params``: every parameter one stage holds, its shard as the
    rules lay it out, in its master dtype: float32 when trained, its own when frozen); 0 without."""
    import torch

    from functional_pp.app.pipeline_parts import pipeline_parts
    from functional_pp.app.preference_run import REFERENCE
    from functional_pp.core.layout import local_shape
    from functional_pp.core.tree import leaves_with_paths
    from functional_pp.step.pipeline import held_by_one_stage
    if mesh.shape.get("pp", 1) < 2:
        return 0
    layers, first, last = pipeline_parts(family, model_cfg, (REFERENCE,) if REFERENCE in decls else ())
    flags = dict(leaves_with_paths(trainable(decls))) if trainable is not None else {}
    total = 0
    for p, d in leaves_with_paths(decls):
        if held_by_one_stage(p, layers, first, last):
            trained = flags.get(p, True) and d.dtype.is_floating_point
            item = torch.float32.itemsize if trained else d.dtype.itemsize
            total += torch.Size(local_shape(d.shape, rules.resolve(d.dims, d.shape, mesh, name=p), mesh)).numel() * item
    return total


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
    est.notes.append(f"rollout: {f'gathered model {gen.gathered_bytes} B + ' if gen.gathered_bytes else ''}"
                     f"compute copy {gen.cast_bytes} B + key / value cache {gen.cache_bytes} B + forward "
                     f"{gen.forward_bytes} B over the held state ({gen.batch} rows x ({gen.prompt} + "
                     f"{gen.new_tokens}) positions)" + (f"; then its {gen.shape.scoring} {gen.scoring_bytes} B"
                                                        if gen.scoring is not None else ""))
    est.rollout = gen
    if rollout > est.peak_bytes:
        est.memory = {**{c: est.memory.get(c, 0) for c in HELD}, **gen.split()}
        est.peak_bytes = rollout


def sets_peak(est: Any) -> bool:
    """Whether the rollout (:func:`hold_rollout`) sets ``est``'s peak."""
    return any(c in est.memory for c in SAMPLING + SCORING if c != "compute copy")
