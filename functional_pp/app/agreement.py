"""Ranks agree before they train (docs/bad_inputs.md §10): every process of a run compares a
fingerprint of what it is about to train on (the resolved config, the data and tokenizer files'
sizes and the hashes of their heads, the training tokens, the code's versions) with the others',
and stops naming the ranks and what differs. A stale copy of the dataset on one node trained
with other losses, exit 0; ranks with another ``max_steps`` ended in a collective timeout."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from functional_pp.app.resume_check import flatten
from functional_pp.config import ConfigError

__all__ = ["fingerprint", "run_fingerprint", "check_agreement", "RanksDisagree"]

HEAD = 1 << 20           # bytes of each file (tokens of the stream) hashed
SHOWN = 6                # differences named in the message


class RanksDisagree(ConfigError):
    """The processes of one run would train on different configs, data or code (exit status 2:
    found before any training)."""


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 200 else f"{text[:120]}... (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]})"


def _keys(config: dict) -> dict[str, Any]:
    """``config``'s leaves by dotted key, a list of mappings (``datasets``) item by item."""
    out = {}
    for key, value in flatten(config).items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                out.update(flatten(item, f"{key}[{i}]."))
        else:
            out[key] = value
    return out


def _file(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD)
        return f"{path.stat().st_size} bytes, head sha256 {hashlib.sha256(head).hexdigest()[:12]}"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"


def _files(root: str | Path) -> list[Path]:
    p = Path(root)
    return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.is_file() else []


def fingerprint(config: dict, paths: Sequence[str | Path], tokens: Any, versions: dict) -> dict[str, str]:
    """``{what: its short description}`` of a run: each key of ``config`` (``datasets[0].path``), each file
    under ``paths`` (size and the hash of its first MiB), the training ``tokens`` (count and the
    hash of the first 2^20) and ``versions``."""
    out = {f"config {k}": _short(v) for k, v in _keys(config).items()}
    for root in paths:
        for f in _files(root):
            out[f"file {f}"] = _file(f)
    arr = np.asarray(tokens[:HEAD], dtype=np.int64)          # (a tensor or an array; a memory map read in part)
    out["training tokens"] = f"{len(tokens)}, head sha256 {hashlib.sha256(arr.tobytes()).hexdigest()[:12]}"
    out.update({f"version {k}": str(v) for k, v in versions.items()})
    return out


def run_fingerprint(cfg: Any, corpus: Any) -> dict[str, str]:
    """:func:`fingerprint` of a training run: ``cfg`` (a ``TrainConfig``), its data and tokenizer
    files, the training tokens of ``corpus`` and the functional_pp and torch versions."""
    import torch

    from functional_pp.app.inputs import data_paths
    from functional_pp.version import __version__
    return fingerprint(cfg.to_dict(), data_paths(cfg), _tokens_of(corpus),
                       {"functional_pp": __version__, "torch": torch.__version__})


def _tokens_of(corpus: Any) -> Any:
    """The corpus's tokens: its ``tokens``; for preference pairs / KTO completions (``sequences()``)
    their ids in order; else the corpus itself."""
    if hasattr(corpus, "tokens"):
        return corpus.tokens
    if hasattr(corpus, "sequences"):
        return np.fromiter((t for seq in corpus.sequences() for t in seq), dtype=np.int64)
    return corpus


def check_agreement(mine: dict[str, str], exchange: Callable[[Any], list]) -> None:
    """Raise :class:`RanksDisagree` unless every rank's fingerprint (``exchange(mine)``: all of
    them in rank order) equals rank 0's, naming each difference with the ranks that hold it."""
    every = exchange(mine)
    first = every[0]
    diffs = []
    for key in sorted(set().union(*every)):
        values = [fp.get(key, "absent") for fp in every]
        if any(v != values[0] for v in values):
            other = [r for r, v in enumerate(values) if v != values[0]]
            diffs.append(f"{key}: rank 0 {first.get(key, 'absent')}, rank{'s' if len(other) > 1 else ''} "
                         f"{', '.join(map(str, other))} {values[other[0]]}")
    if diffs:
        more = f" and {len(diffs) - SHOWN} more" if len(diffs) > SHOWN else ""
        raise RanksDisagree(f"the {len(every)} ranks of this run would train on different inputs: "
                            + "; ".join(diffs[:SHOWN]) + more + ". Give every rank the same config, data "
                            "files, tokenizer and functional_pp / torch versions (a stale copy on one node?)")
