"""Paths in a config read as a shell user expects (docs/bad_inputs.md §12): ``~`` is the home
directory and ``$VAR`` / ``${VAR}`` environment variables are expanded in every key that names
a file or directory (``output_dir: ~/runs`` wrote into a folder literally named ``~``); a
variable that is not set is refused, naming the key and the variable."""
from __future__ import annotations

import os
import re

from functional_pp.config.schema import Issues

__all__ = ["expand_paths", "PATH_KEYS"]

#: keys (after alias resolution: ``section.key``) whose values are paths; ``datasets[].path`` too
PATH_KEYS = ("base_model", "tokenizer", "dataset_prepared_path", "resume_from_checkpoint", "lora_model_dir",
             "logging.output_dir", "data.path", "data.tokenizer")
_VAR = re.compile(r"\$(\w+|\{[^}]*\})")


def expand_paths(raw: dict, issues: Issues) -> None:
    """Expand ``~`` and environment variables in ``raw``'s path values, in place."""
    for key in PATH_KEYS:
        *section, name = key.split(".")
        node = raw.get(section[0]) if section else raw
        if isinstance(node, dict) and isinstance(node.get(name), str):
            node[name] = _expand(node[name], key, issues)
    for i, entry in enumerate(raw.get("datasets") or [] if isinstance(raw.get("datasets"), list) else []):
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            entry["path"] = _expand(entry["path"], f"datasets[{i}].path", issues)


def _expand(value: str, key: str, issues: Issues) -> str:
    out = os.path.expandvars(value)
    unset = [m.group(1).strip("{}") for m in _VAR.finditer(out)]
    if unset:
        issues.add(f"{key}: {value!r} names the environment variable {', '.join(unset)}, which is not set; "
                   f"set it or write the path out")
        return value
    return os.path.expanduser(out)
