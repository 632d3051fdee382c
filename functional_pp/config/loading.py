"""Reading a training config: a YAML file (plus ``--set`` overrides) or a mapping, aliases
rewritten (``config.aliases``), every key and value checked by the generic validator
(``config.schema``) with *all* problems of a file reported at once; and the way back, a
config as a mapping that reads back to the same config (``docs/config.md``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import yaml

from functional_pp.config.aliases import DATASET_UNSUPPORTED, normalize
from functional_pp.config.keys import ADAM_OPTIMIZERS, SECTION_KEYS, foreign_optimizer_keys
from functional_pp.config.overrides import apply_overrides
from functional_pp.config.paths import expand_paths
from functional_pp.config.schema import ConfigError, Issues, parse_section
from functional_pp.config.sections import CheckpointConfig, DataConfig, DatasetConfig, LoggingConfig, ModelConfig

__all__ = ["read_yaml", "build_from_dict", "config_to_dict"]

_SECTIONS = {"data": DataConfig, "logging": LoggingConfig, "checkpoint": CheckpointConfig}


def read_yaml(path: str | Path, overrides: list[str] | None = None) -> dict:
    """The mapping of YAML file ``path`` with ``key=value`` overrides applied."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        d = yaml.safe_load(p.read_text()) or {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}; save it as UTF-8 text "
                          f"readable by this user") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    if not isinstance(d, dict):
        raise ConfigError(f"{p}: the config must be a mapping of keys to values")
    return apply_overrides(d, overrides or [])


def build_from_dict(cls: type, d: Mapping[str, Any], name: str, source: str) -> Any:
    """A ``cls`` (:class:`~functional_pp.config.TrainConfig`) from mapping ``d``, checking key
    names, value types and ranges; every problem is reported at once."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"the config must be a mapping of keys to values, got {d!r}")
    issues = Issues(source)
    raw, notes = normalize(dict(d), issues)
    expand_paths(raw, issues)         # ~ and $VARS in paths (config/paths.py)
    known = set(cls.valid_keys()) | {"name"}
    blank = sorted(k for k, v in raw.items() if v is None and k not in known)
    for k in blank:                   # a blank key asks for nothing, known here or not
        raw.pop(k)
    if blank:
        notes.append(f"{', '.join(blank)} (blank: unset)")
    top = parse_section(cls, raw, "", issues, skip=SECTION_KEYS + ("rules", "datasets"))
    if "name" in raw:
        issues.add("unknown key 'name' (the run is named after the config file)")
        top.pop("name", None)
    optimizer = top.get("optimizer", "adamw")
    for k in foreign_optimizer_keys(optimizer):
        if k in top:
            issues.add(f"{k} does not apply to optimizer {optimizer!r}; remove it or set "
                       f"optimizer: {'sgd' if optimizer in ADAM_OPTIMIZERS else 'adamw'}")
    sections = {key: sec(**parse_section(sec, raw.get(key), key, issues)) for key, sec in _SECTIONS.items()}
    cfg = cls(**top, model=ModelConfig.from_value(raw.get("model"), issues), **sections,
              datasets=_parse_datasets(raw.get("datasets"), issues),
              rules=_parse_rules(raw.get("rules"), issues), name=name)
    # keys given a value (a blank one is unset): what "given" means to derived values
    cfg._given = set(top) | {k for k in raw if k not in top and raw[k] is not None}
    cfg.notes = notes
    if "model" in raw and cfg.base_model is not None:
        issues.add("give either base_model (start from a Hugging Face directory) or model "
                   "(a preset, trained from scratch), not both")
    cfg._check_values(issues)         # values that parsed are range-checked too
    issues.raise_if_any()
    return cfg


def _parse_rules(value: Any, issues: Issues) -> dict:
    """``rules``: dimension name -> mesh axis, list of mesh axes, or null."""
    rules = value or {}
    if not isinstance(rules, Mapping):
        issues.add(f"'rules' must map dimension names to mesh axes, got {rules!r}")
        return {}
    for k, v in rules.items():
        ok = v is None or isinstance(v, str) or (isinstance(v, (list, tuple))
                                                 and all(isinstance(a, str) for a in v))
        if not ok:
            issues.add(f"rules.{k} must be a mesh axis name, a list of them or null, got {v!r}")
    return {str(k): (list(v) if isinstance(v, (list, tuple)) else v) for k, v in rules.items()}


def _parse_datasets(value: Any, issues: Issues) -> list[DatasetConfig] | None:
    if value is None:
        return None
    if isinstance(value, (str, Mapping)):
        value = [value]
    if not isinstance(value, list) or not value:
        issues.add(f"datasets must be a non-empty list of entries (path, type, ...), got {value!r}")
        return None
    out = []
    for i, entry in enumerate(value):
        if isinstance(entry, str):
            entry = {"path": entry}
        if isinstance(entry, Mapping):
            refused: dict[str, list[str]] = {}
            for k in [k for k in entry if k in DATASET_UNSUPPORTED]:
                if entry[k] not in (None, False):
                    refused.setdefault(DATASET_UNSUPPORTED[k], []).append(k)
            for why, keys in refused.items():
                issues.add(f"'datasets[{i}].{keys[0]}' is not supported"
                           f"{' (with ' + ', '.join(keys[1:]) + ')' if keys[1:] else ''}: {why}")
            entry = {k: v for k, v in entry.items() if k not in DATASET_UNSUPPORTED}
        kw = parse_section(DatasetConfig, entry, f"datasets[{i}]", issues)
        if isinstance(entry, Mapping) and "path" not in entry:
            issues.add(f"datasets[{i}] needs a path")
            continue
        if "path" in kw:
            out.append(DatasetConfig(**kw))
    return out


def config_to_dict(cfg: Any) -> dict:
    """A JSON-able dict of ``cfg`` that :func:`build_from_dict` reads back."""
    foreign = foreign_optimizer_keys(cfg.optimizer)
    out = {k: getattr(cfg, k) for k in cfg.valid_keys()
           if k not in foreign and k not in SECTION_KEYS and k not in ("rules", "datasets")}
    for k in ("warmup_steps", "min_learning_rate"):      # one of each pair was given
        if k not in cfg._given and k.replace("_steps", "_ratio") in out:
            out.pop(k)
    if cfg.warmup_ratio is None:
        out.pop("warmup_ratio")
    if cfg.cosine_min_lr_ratio is None:
        out.pop("cosine_min_lr_ratio")
    else:
        out.pop("min_learning_rate", None)
    if cfg.base_model is None:
        out["model"] = cfg.model.to_dict()
    out["datasets"] = (None if cfg.datasets is None
                       else [dataclasses.asdict(e) for e in cfg.datasets])
    for key in _SECTIONS:
        out[key] = dataclasses.asdict(getattr(cfg, key))
    out["rules"] = dict(cfg.rules)
    if cfg.saves_per_epoch:              # derived from it (set_per_epoch): written once
        out["checkpoint"]["save_every"] = CheckpointConfig().save_every
    if cfg.evals_per_epoch:
        out["eval_steps"] = None
    return out
