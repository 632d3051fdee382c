"""Which model a training config trains: its family (:mod:`functional_pp.models.family`,
``model.family``) and that family's config, from the ``model`` section (a preset and
overrides) or from a Hugging Face ``base_model`` directory's ``config.json``."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from functional_pp.config.schema import ConfigError
from functional_pp.models.family import ModelFamily, UnknownFamilyError, get_family

__all__ = ["model_family", "model_config"]


def model_family(cfg: Any) -> ModelFamily:
    """The :class:`ModelFamily` named by ``cfg.model.family``."""
    try:
        return get_family(cfg.model.family)
    except UnknownFamilyError as exc:
        raise ConfigError(f"model.family: {exc}") from exc


def model_config(cfg: Any) -> Any:
    """The model's config (``llama.Config`` for llama): from ``base_model/config.json``, or the
    preset and overrides of the ``model`` section."""
    overrides = getattr(cfg, "overrides_of_model_config", None)
    if cfg.base_model is None:
        if overrides:
            raise ConfigError("overrides_of_model_config (model_config) replaces keys of base_model's config.json; "
                              "without base_model give them in the model section (model: {preset: ..., KEY: ...})")
        return _with_moe_options(cfg, cfg.model.build())
    family = model_family(cfg)
    if family.hf_config_from_dict is None:
        raise ConfigError(f"base_model: model family {family.name!r} has no Hugging Face mapping; "
                          f"train it from a preset (model: {{family: {family.name}, preset: ...}})")
    path = Path(cfg.base_model) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"base_model {cfg.base_model!r}: cannot read {path}: "
                          f"{exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"base_model {cfg.base_model!r}: {path} is not valid JSON: {exc}") from exc
    if overrides:
        if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
            raise ConfigError(f"overrides_of_model_config must map config.json keys to values, got {overrides!r}")
        hf = {**hf, **overrides}          # as transformers' setattr on the loaded config (Axolotl's)
    try:
        model = family.hf_config_from_dict(hf)
    except (ValueError, KeyError, TypeError) as exc:
        where = f" with overrides_of_model_config {overrides}" if overrides else ""
        raise ConfigError(f"base_model {cfg.base_model!r}{where}: {exc}") from exc
    return _with_moe_options(cfg, _with_added_tokens(cfg, model))


_MOE_OPTIONS = ("router_z_loss_coef", "capacity_factor", "expert_parallel_token_capacity")
_MODEL_FIELD = {"expert_parallel_token_capacity": "token_capacity"}       # (the config key -> the model's)


def _with_moe_options(cfg: Any, model: Any) -> Any:
    """``model`` with the config's mixture-of-experts training options (``router_z_loss_coef``,
    ``capacity_factor``, ``expert_parallel_token_capacity`` as ``token_capacity``) where given; refused by name for a model without experts."""
    given = {k: getattr(cfg, k, None) for k in _MOE_OPTIONS if getattr(cfg, k, None) is not None}
    if not given:
        return model
    if not getattr(model, "experts", 0):
        raise ConfigError(f"{', '.join(given)}: the model has no mixture of experts (experts=0); remove "
                          f"{'them' if len(given) > 1 else 'it'}")
    try:
        return dataclasses.replace(model, **{_MODEL_FIELD.get(k, k): v for k, v in given.items()})
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _with_added_tokens(cfg: Any, model: Any) -> Any:
    """``model`` with its vocabulary grown to hold ``cfg.tokens`` (Axolotl's added tokens) when
    the tokenizer with them is larger than the model's embedding (transformers' resize), rounded
    up to a multiple of 32 with ``resize_token_embeddings_to_32x`` (Axolotl's rule: never shrunk)."""
    if not (cfg.tokens or cfg.resize_token_embeddings_to_32x) or not hasattr(model, "vocab"):
        return model
    from functional_pp.data.tokenizer import HFTokenizer
    path = cfg.tokenizer or cfg.data.tokenizer or cfg.base_model
    try:
        tok = HFTokenizer(path, model_dir=cfg.base_model)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        raise ConfigError(f"tokens: need the tokenizer to add them to: {exc}") from exc
    tok.add_tokens(cfg.tokens or [])
    want = -(-tok.vocab_size // 32) * 32 if cfg.resize_token_embeddings_to_32x else tok.vocab_size
    return dataclasses.replace(model, vocab=want) if want > model.vocab else model
