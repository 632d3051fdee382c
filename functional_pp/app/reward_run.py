"""What ``reward_model`` / ``process_reward_model`` change in a run (docs/reward_models.md): the
objective (:mod:`functional_pp.preference.reward`) over the score head's scores
(:mod:`functional_pp.models.score_head`) through the adapters if any, and the data
(:mod:`functional_pp.data.reward_data`), read by the preference loop's pair loader. With an
adapter the score head is trained whole (peft's sequence / token classification tasks save it:
``modules_to_save``)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from functional_pp.config import ConfigError, TrainConfig
from functional_pp.preference.reward import RewardSpec, process_reward_loss, reward_loss

__all__ = ["is_reward_run", "reward_spec", "with_head_saved", "reward_objective", "load_reward_data"]


def is_reward_run(cfg: TrainConfig) -> bool:
    return bool(cfg.reward_model or cfg.process_reward_model)


def reward_spec(cfg: TrainConfig) -> RewardSpec | None:
    """The run's reward objective, or None when it trains none."""
    if not is_reward_run(cfg):
        return None
    return RewardSpec("reward" if cfg.reward_model else "process",
                      center_rewards_coefficient=cfg.center_rewards_coefficient)


def with_head_saved(lora: Any, decls: dict) -> Any:
    """The LoRA config of a run with a score head: the head among ``modules_to_save`` (trained
    whole, written to the PEFT directory; ``lora_target_linear`` leaves it)."""
    if lora is None:
        return None
    head = tuple(k for k in ("score", "score_bias") if k in decls)
    return dataclasses.replace(lora, modules_to_save=tuple(dict.fromkeys((*lora.modules_to_save, *head))))


def reward_objective(cfg: TrainConfig, spec: RewardSpec, model_cfg: Any, lora: Any, base_decls: Any) -> tuple:
    """``(loss, declarations, trainable mask)`` of a reward-model run (``lora``: :func:`with_head_saved`'s)."""
    from functional_pp.app.inputs import frozen_and_adapters
    from functional_pp.models import score_head
    fn = score_head.sequence_scores if spec.kind == "reward" else score_head.token_scores
    scores, decls, trainable = frozen_and_adapters(cfg, lora,
                                                   functools.partial(fn, cfg=model_cfg), base_decls)
    loss = reward_loss(spec, scores) if spec.kind == "reward" else process_reward_loss(scores)
    return loss, decls, trainable


def load_reward_data(cfg: TrainConfig):
    """The run's :class:`~functional_pp.app.inputs.RunData`: Bradley-Terry pairs or stepwise rows,
    ``val_set_size`` of them held out (chosen by the seed)."""
    from functional_pp.app.inputs import RunData, load_tokenizer
    from functional_pp.data.formats import split_held_out
    from functional_pp.data.reward_data import build_scored_pairs, build_stepwise
    tok = load_tokenizer(cfg)
    try:
        if cfg.reward_model:
            data = build_scored_pairs(cfg.datasets, tok, seq_len=cfg.sequence_len, chat_template=cfg.chat_template,
                                      chat_template_jinja=cfg.chat_template_jinja)
        else:
            data = build_stepwise(cfg.datasets, tok, seq_len=cfg.sequence_len, num_labels=cfg.num_labels or 2)
        if not cfg.val_set_size:
            return RunData(data, None, tok)
        return RunData(*split_held_out(data, cfg.val_set_size, cfg.seed, data.unit), tok)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        raise ConfigError(f"datasets: {exc}") from exc
