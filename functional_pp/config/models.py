"""Which model a training config trains: its family (:mod:`functional_pp.models.family`,
``model.family``) and that family's config, from the ``model`` section (a preset and
overrides) or from a Hugging Face ``base_model`` directory's ``config.json``."""
from __future__ import annotations

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
    if cfg.base_model is None:
        return cfg.model.build()
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
    try:
        return family.hf_config_from_dict(hf)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"base_model {cfg.base_model!r}: {exc}") from exc
