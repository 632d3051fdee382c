"""GRPO's settings from Axolotl's ``trl:`` section (TRL 1.16 ``GRPOConfig`` names and defaults;
docs/preference.md "GRPO"): :class:`GRPOSpec` and :func:`grpo_spec` reading the section, which
refuses by name a key that changes the math and is not built, and accepts the keys that only
choose a generation engine (vLLM's: generation runs in-process here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from functional_pp.preference.grpo import GRPO_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, SCALE_REWARDS

__all__ = ["GRPOSpec", "grpo_spec", "ENGINE_KEYS", "AGGREGATIONS"]

#: TRL's ``multi_objective_aggregation`` (``normalize_then_sum``: GDPO, Axolotl's ``rl: gdpo``)
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
#: keys that choose where completions are generated or what is printed, not what is computed
ENGINE_KEYS = ("use_vllm", "vllm_mode", "vllm_device", "vllm_gpu_memory_utilization", "vllm_max_model_len",
               "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_dtype",
               "vllm_enable_sleep_mode", "vllm_tensor_parallel_size", "vllm_server_base_url",
               "log_completions", "num_completions_to_print", "wandb_log_unique_prompts",
               "vllm_importance_sampling_correction", "async_prefetch")
#: keys of TRL / Axolotl that change the math and are not built -> what they do
NOT_BUILT = {
    "reward_processing_classes": "reward models (reward_funcs here are Python functions)",
    "min_p": "min-p sampling", "repetition_penalty": "a repetition penalty in sampling",
    "top_entropy_quantile": "training only the highest-entropy tokens",
    **{k: "TRL's entropy bonus (the entropy metric is logged)" for k in (
        "entropy_coef", "use_adaptive_entropy", "entropy_target", "entropy_coef_delta", "entropy_coef_min",
        "entropy_coef_max")},
    "generation_batch_size": "generation batches larger than a step (one generation per step here)",
    "steps_per_generation": "generation batches larger than a step (one generation per step here)",
    "max_prompt_length": "cutting prompts (here a prompt longer than sequence_len - max_completion_length is "
                         "left out and counted)",
    "rollout_func": "a custom rollout", "use_liger_loss": "Liger's fused GRPO loss (the same math: remove it)",
    "cast_lm_head_to_fp32": "an fp32 LM head",
}
#: the values of :data:`NOT_BUILT` keys that are what is built (accepted)
_BUILT_VALUES: dict[str, Any] = {}
_BOOL_SCALE = {True: "group", False: "none"}


@dataclass(frozen=True)
class GRPOSpec:
    """GRPO's arguments (TRL's names and defaults)."""

    reward_funcs: tuple[str, ...]
    reward_weights: tuple[float, ...] | None = None
    num_generations: int = 8
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    mask_truncated_completions: bool = False
    num_iterations: int = 1                                # updates per generation (old log-probs kept)
    importance_sampling_level: str = "token"               # sequence: GSPO
    num_generations_eval: int | None = None                # completions per held-out prompt (None: num_generations)
    sync_ref_model: bool = False                           # TR-DPO: the reference mixed toward the policy
    ref_model_mixup_alpha: float = 0.6                     # ... ref = alpha * policy + (1 - alpha) * ref
    ref_model_sync_steps: int = 512                        # ... every this many steps
    engine_keys: tuple[str, ...] = field(default=())      # vLLM's and the like, accepted (in-process here)

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    @property
    def eval_generations(self) -> int:
        return self.num_generations if self.num_generations_eval is None else self.num_generations_eval

    def weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_funcs)


def grpo_spec(rl: str, trl: Mapping[str, Any] | None, vllm: Mapping[str, Any] | None = None) -> GRPOSpec:
    """The :class:`GRPOSpec` of ``rl: grpo`` (or ``gdpo``: TRL's ``normalize_then_sum``) and its
    ``trl:`` section; a :class:`ValueError` names each problem's key."""
    trl = dict(trl or {})
    if not isinstance(trl, dict):
        raise ValueError(f"trl must be a mapping of TRL's GRPO arguments, got {trl!r}")
    problems = []
    for key in trl:
        if key in NOT_BUILT and trl[key] not in (None, False, _BUILT_VALUES.get(key)):
            problems.append(f"trl.{key}: {NOT_BUILT[key]} is not built; remove it")
    known = {f for f in GRPOSpec.__dataclass_fields__ if f != "engine_keys"} | set(ENGINE_KEYS) | set(NOT_BUILT)
    for key in trl:
        if key not in known:
            read = ", ".join(sorted(known - set(NOT_BUILT)))
            problems.append(f"trl.{key} is not a GRPO key read here (read: {read})")
    funcs = trl.get("reward_funcs")
    if not funcs or not isinstance(funcs, list) or not all(isinstance(f, str) for f in funcs):
        problems.append(f"trl.reward_funcs must list the reward functions as module.function paths, e.g. "
                        f"[rewards.format_reward], got {funcs!r}")
    weights = trl.get("reward_weights")
    if weights is not None and (not isinstance(weights, list) or len(weights) != len(funcs or [])):
        problems.append(f"trl.reward_weights must give one weight per reward function ({len(funcs or [])}), "
                        f"got {weights!r}")
    if problems:
        raise ValueError("; ".join(problems))
    scale = trl.get("scale_rewards", "group")
    scale = _BOOL_SCALE.get(scale, scale) if isinstance(scale, bool) else scale
    default_agg = "normalize_then_sum" if str(rl).lower() == "gdpo" else "sum_then_normalize"
    args = {k: v for k, v in trl.items() if k in GRPOSpec.__dataclass_fields__ and v is not None}
    args.update(reward_funcs=tuple(funcs), scale_rewards=scale,
                reward_weights=None if weights is None else tuple(float(w) for w in weights),
                multi_objective_aggregation=trl.get("multi_objective_aggregation") or default_agg,
                engine_keys=tuple(k for k in trl if k in ENGINE_KEYS and trl[k] not in (None, False))
                + tuple(f"vllm.{k}" for k in (vllm or {})))
    spec = GRPOSpec(**args)
    _check(spec, rl)
    return spec


def _check(spec: GRPOSpec, rl: str) -> None:
    bad = []
    if spec.num_generations < 2:
        bad.append(f"trl.num_generations must be >= 2 (the advantage compares a prompt's completions), "
                   f"got {spec.num_generations}")
    if spec.num_generations_eval is not None and spec.num_generations_eval < 1:
        bad.append(f"trl.num_generations_eval must be >= 1, got {spec.num_generations_eval}")
    if spec.num_iterations < 1:
        bad.append(f"trl.num_iterations must be >= 1, got {spec.num_iterations}")
    if spec.max_completion_length < 1:
        bad.append(f"trl.max_completion_length must be >= 1, got {spec.max_completion_length}")
    if not spec.temperature > 0:
        bad.append(f"trl.temperature must be > 0, got {spec.temperature}")
    if not 0 < spec.top_p <= 1:
        bad.append(f"trl.top_p must be in (0, 1], got {spec.top_p}")
    if spec.top_k < 0:
        bad.append(f"trl.top_k must be >= 0 (0: no limit), got {spec.top_k}")
    if spec.beta < 0:
        bad.append(f"trl.beta must be >= 0, got {spec.beta}")
    if spec.sync_ref_model and not spec.beta:
        bad.append("trl.sync_ref_model mixes the reference toward the policy, but trl.beta is 0 (no reference): "
                   "set trl.beta > 0 or remove sync_ref_model")
    if not 0 <= spec.ref_model_mixup_alpha <= 1:
        bad.append(f"trl.ref_model_mixup_alpha must be in [0, 1], got {spec.ref_model_mixup_alpha}")
    if spec.ref_model_sync_steps < 1:
        bad.append(f"trl.ref_model_sync_steps must be >= 1, got {spec.ref_model_sync_steps}")
    if spec.loss_type not in GRPO_LOSS_TYPES:
        bad.append(f"trl.loss_type {spec.loss_type!r} is not built; choose one of {', '.join(GRPO_LOSS_TYPES)}")
    if spec.scale_rewards not in SCALE_REWARDS:
        bad.append(f"trl.scale_rewards {spec.scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)} (or true / "
                   f"false)")
    if spec.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        bad.append(f"trl.importance_sampling_level {spec.importance_sampling_level!r} is not one of "
                   f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
    if spec.multi_objective_aggregation not in AGGREGATIONS:
        bad.append(f"trl.multi_objective_aggregation {spec.multi_objective_aggregation!r} is not one of "
                   f"{', '.join(AGGREGATIONS)}")
    if bad:
        raise ValueError("; ".join(bad))
