"""A small manager: one directory of step checkpoints, saving with retention, loading the latest."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from functional_pp.checkpoint import format as fmt
from functional_pp.checkpoint.load import Restored, load_checkpoint
from functional_pp.checkpoint.save import save_checkpoint
from functional_pp.core.layout import Rules


class CheckpointManager:
    """``CheckpointManager(dir, keep_last=3, rules=rules)``: ``save(step, tree, specs)`` on every
    device, ``latest()`` -> newest complete step (or None), ``load(specs)`` -> :class:`Restored`."""

    def __init__(self, directory: str | os.PathLike, keep_last: int | None = None, *,
                 rules: Rules | None = None):
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.rules = rules

    def save(self, step: int, tree: dict[str, Any], specs: dict[str, Any] | None = None, *,
             metadata: dict | None = None, config: dict | None = None) -> Path:
        """Save ``tree`` as step ``step`` (see :func:`save_checkpoint`)."""
        return save_checkpoint(self.directory, step, tree, specs, rules=self.rules,
                               metadata=metadata, config=config, keep_last=self.keep_last)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return list(fmt.complete_steps(self.directory))

    def latest(self) -> int | None:
        """The step ``latest`` points at (or the newest complete one); None if there is none."""
        path = fmt.latest_checkpoint(self.directory)
        return None if path is None else int(fmt.STEP_RE.match(path.name).group(1))

    def path(self, step: int) -> Path:
        return self.directory / fmt.step_dir_name(step)

    def load(self, specs: dict[str, Any] | None = None, *, step: int | None = None,
             rules: Rules | None = None, **kwargs: Any) -> Restored:
        """Load ``step`` (default: the latest) with :func:`load_checkpoint`; ``rules`` default
        to the manager's."""
        return load_checkpoint(self.directory, specs, step=step,
                               rules=rules if rules is not None else self.rules, **kwargs)


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch RNG states as uint8 tensors (``{"cpu": ..., "cuda:0": ...}``)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            state[f"cuda:{i}"] = torch.cuda.get_rng_state(i)
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore the states returned by :func:`rng_state`."""
    for name, value in state.items():
        value = value.to(device="cpu", dtype=torch.uint8)
        if name == "cpu":
            torch.set_rng_state(value)
        elif name.startswith("cuda:"):
            torch.cuda.set_rng_state(value, int(name.split(":")[1]))
        else:
            raise ValueError(f"unknown RNG state {name!r}")
