"""The frozen model a run holds beside the one it trains (docs/memory.md "Models a run holds"):
the reference of DPO / IPO / KTO and of GRPO with a KL term, EBFT's feature model. Under full
fine-tuning it is a frozen copy of the initial parameters under the parameter tree's
``reference`` key, declared and sharded like the policy, in the compute dtype
(app/preference_run.py); under an adapter it is the base with the adapters left out and with
``precompute_ref_log_probs`` it is not held at all (nothing more in memory either way).

The answer comes from the run's own objective (the declarations ``train`` builds), so
``validate --memory``, ``plan`` and ``layout: auto`` hold what the run holds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from functional_pp.config import TrainConfig, model_family

__all__ = ["HeldModel", "held_model", "pair_objective", "unpaired_objective", "own_objective", "step_batch"]


@dataclass(frozen=True)
class HeldModel:
    """What a run holds besides the trained model: ``decls`` the frozen copy's declarations (in
    the dtype it is held in) or None when the run holds no copy, ``why`` then saying why."""
    name: str                 # "reference model" or "feature model"
    decls: Any = None
    why: str = ""


def held_model(cfg: TrainConfig, model_cfg: Any) -> HeldModel | None:
    """The frozen model ``cfg``'s objective holds (:class:`HeldModel`), or None when the
    objective needs none (supervised fine-tuning, ORPO, SimPO, GRPO without a KL term, a reward
    model)."""
    from functional_pp.app import ebft_run, grpo_run
    from functional_pp.app.preference_run import REFERENCE, preference_objective, preference_spec
    from functional_pp.preference.objective import PreferenceSpec
    if cfg.rl is None:
        return None
    family = model_family(cfg)
    base_decls, lora = family.param_decls(model_cfg), cfg.lora_config()
    name = "reference model"
    if grpo_run.is_grpo(cfg):
        spec = grpo_run.grpo_settings(cfg)
        needed = spec.needs_reference
        decls = grpo_run.grpo_objective_of(cfg, spec, family, model_cfg, lora, base_decls)[1] if needed else None
    elif ebft_run.is_ebft(cfg):
        name, needed = "feature model", True
        decls = ebft_run.ebft_objective_of(cfg, ebft_run.ebft_settings(cfg), family, model_cfg, lora, base_decls)[1]
    else:
        spec = preference_spec(cfg)
        needed = isinstance(spec, PreferenceSpec) and spec.needs_reference
        decls = preference_objective(cfg, spec, family, model_cfg, lora, base_decls)[1] if needed else None
    if not needed:
        return None
    if REFERENCE in decls:
        return HeldModel(name, decls[REFERENCE])
    if lora is not None:
        return HeldModel(name, why="none held: the base with the adapters left out")
    return HeldModel(name, why="none held: precompute_ref_log_probs computed it once before the first step")


def pair_objective(cfg: TrainConfig) -> bool:
    """Whether ``cfg``'s step is a pair objective's (DPO, IPO, ORPO, SimPO without precomputed
    reference log-probabilities): the planner then runs the objective itself on a batch of pairs
    (:func:`step_batch`), the policy on the chosen and on the rejected rows and the reference
    beside it, as the step does."""
    from functional_pp.app.preference_run import preference_spec
    from functional_pp.preference.objective import PreferenceSpec
    if cfg.rl is None or str(cfg.rl).lower() in ("kto", "grpo", "gdpo", "ebft"):
        return False
    spec = preference_spec(cfg)
    return isinstance(spec, PreferenceSpec) and not (cfg.precompute_ref_log_probs and spec.needs_reference)


def unpaired_objective(cfg: TrainConfig) -> bool:
    """Whether ``cfg``'s step is KTO's without precomputed reference log-probabilities: the
    planner then runs KTO's own loss on its batch of unpaired completions (:func:`step_batch`:
    the completions, their KL rows and the ``desirable`` column)."""
    return str(cfg.rl).lower() == "kto" and not cfg.precompute_ref_log_probs


def own_objective(cfg: TrainConfig) -> bool:
    """Whether the planner runs ``cfg``'s preference or reward objective itself (a pair
    objective's, KTO's, a reward model's over its score head), not the model's loss on
    ``tokens``."""
    from functional_pp.app.reward_run import is_reward_run
    return pair_objective(cfg) or unpaired_objective(cfg) or is_reward_run(cfg)


def step_batch(cfg: TrainConfig, global_batch: int, row: int) -> dict:
    """The global batch spec a dry-run of ``cfg``'s step runs: ``global_batch`` pairs of chosen
    and rejected rows (:func:`pair_objective`; a reward model's with their scored-token one-hots,
    margins and weights), KTO's completions with their KL rows and the
    float ``desirable`` column (data/unpaired.py; ``apo_zero_unpaired`` reads no KL rows), else
    rows of ``tokens`` and ``labels``."""
    import torch
    spec = ((global_batch, row), "batch seq")
    if pair_objective(cfg):
        keys = [*(f"{side}_{k}" for side in ("chosen", "rejected") for k in ("tokens", "labels")), "chosen_lm_labels"]
        return {k: spec for k in keys}                          # (data/pairs.py pair_rows; ORPO reads the last)
    if cfg.reward_model:                                        # (data/reward_data.py ScoredPairSet.batch_rows)
        floats = ("chosen_last", "rejected_last", "margin", "pair_weight")
        return {**{k: spec for k in ("chosen_tokens", "rejected_tokens")},
                **{k: (*spec, torch.float32) for k in floats}}
    if unpaired_objective(cfg):
        kl = [] if (cfg.kto_loss_type or "kto") == "apo_zero_unpaired" else ["kl_tokens", "kl_labels"]
        return {**{k: spec for k in ("tokens", "labels", *kl)}, "desirable": (*spec, torch.float32)}
    return {k: spec for k in ("tokens", "labels")}
