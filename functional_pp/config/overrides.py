"""``--set key=value`` overrides of a YAML config (``data.path=x.txt``, ``tp_size=2``), applied
to the raw mapping before it is checked; an override replaces its key under every spelling
(Axolotl / Accelerate aliases, ``config.aliases``)."""
from __future__ import annotations

import copy

import yaml

from functional_pp.config.aliases import ALIASES
from functional_pp.config.schema import ConfigError

__all__ = ["apply_overrides"]


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """Apply ``key=value`` overrides (``data.path=x.txt``, ``tp_size=2``); values are YAML."""
    out = copy.deepcopy(d)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not raw.strip():             # `--set learning_rate=$LR` with LR unset: not "the default"
            raise ConfigError(f"--set {item!r}: the value of {key} is empty (an unset shell variable?); "
                              f"give a value, or {key}=null to unset the key")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {exc}") from exc
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None or (isinstance(child, str) and part == "model"):
                child = {"preset": child} if isinstance(child, str) else {}
                node[part] = child
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[:i + 1])!r} is not a section")
            node = child
        node[parts[-1]] = value
        _drop_other_spellings(out, key)
    return out


def _drop_other_spellings(d: dict, key: str) -> None:
    """An override replaces the key under any of its names (``output_dir`` and
    ``logging.output_dir`` are one key)."""
    canonical = ALIASES[key][0] if key in ALIASES else key
    for name in [a for a, (c, _) in ALIASES.items() if c == canonical] + [canonical]:
        if name == key:
            continue
        parts = name.split(".")
        node = d
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(parts[-1], None)
