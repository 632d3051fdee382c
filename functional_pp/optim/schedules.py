"""Learning-rate schedules: ``step -> float32 tensor``, built from torch ops only.

Every schedule accepts a 0-dim integer/float tensor (e.g. the int64 step
counter kept in optimizer state) or a plain Python int/float, and returns a
0-dim ``float32`` tensor (on the step's device).  No Python branching on tensor
values, so they trace under ``torch.compile(fullgraph=True)`` without
recompiling per step.

Step convention (as optax): the optimizer evaluates the schedule with the
number of *previous* updates, i.e. step ``0`` for the first update.  Warmup is
linear from ``0`` at step ``0`` to ``peak`` at step ``warmup_steps``.
"""

from __future__ import annotations

import math
from typing import Callable, Union

import torch

__all__ = [
    "Schedule",
    "constant",
    "linear_warmup",
    "warmup_cosine_decay",
    "warmup_linear_decay",
]

StepLike = Union[int, float, torch.Tensor]
Schedule = Callable[[StepLike], torch.Tensor]


def _as_step(step: StepLike) -> torch.Tensor:
    """Step as a float32 tensor (Python numbers are converted)."""
    if isinstance(step, torch.Tensor):
        return step.to(torch.float32)
    return torch.tensor(float(step), dtype=torch.float32)


def constant(value: float) -> Schedule:
    """``lr(step) = value``."""

    def schedule(step: StepLike) -> torch.Tensor:
        return torch.full_like(_as_step(step), float(value))

    return schedule


def _warmup(s: torch.Tensor, peak: float, warmup_steps: int) -> torch.Tensor:
    if warmup_steps <= 0:
        return torch.full_like(s, float(peak))
    return float(peak) * torch.clamp(s / float(warmup_steps), 0.0, 1.0)


def linear_warmup(peak: float, warmup_steps: int) -> Schedule:
    """``peak * min(step / warmup_steps, 1)`` (constant ``peak`` afterwards)."""

    def schedule(step: StepLike) -> torch.Tensor:
        return _warmup(_as_step(step), peak, warmup_steps)

    return schedule


def _decay_fraction(s: torch.Tensor, warmup_steps: int, total_steps: int) -> torch.Tensor:
    """Fraction of the decay phase done, clamped to [0, 1]."""
    span = float(max(total_steps - warmup_steps, 1))
    return torch.clamp((s - float(warmup_steps)) / span, 0.0, 1.0)


def warmup_cosine_decay(peak: float, warmup_steps: int, total_steps: int, end_value: float = 0.0) -> Schedule:
    """Linear warmup to ``peak``, then cosine decay to ``end_value`` at ``total_steps``.

    For ``warmup_steps <= step``:
    ``end + (peak - end) * 0.5 * (1 + cos(pi * (step - warmup) / (total - warmup)))``;
    ``end_value`` for ``step >= total_steps``.
    """
    if total_steps < warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")

    def schedule(step: StepLike) -> torch.Tensor:
        s = _as_step(step)
        frac = _decay_fraction(s, warmup_steps, total_steps)
        decayed = float(end_value) + (float(peak) - float(end_value)) * 0.5 * (1.0 + torch.cos(math.pi * frac))
        return torch.where(s < float(warmup_steps), _warmup(s, peak, warmup_steps), decayed)

    return schedule


def warmup_linear_decay(peak: float, warmup_steps: int, total_steps: int, end_value: float = 0.0) -> Schedule:
    """Linear warmup to ``peak``, then linear decay to ``end_value`` at ``total_steps``.

    For ``warmup_steps <= step``:
    ``end + (peak - end) * (1 - (step - warmup) / (total - warmup))``, clamped.
    """
    if total_steps < warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")

    def schedule(step: StepLike) -> torch.Tensor:
        s = _as_step(step)
        frac = _decay_fraction(s, warmup_steps, total_steps)
        decayed = float(end_value) + (float(peak) - float(end_value)) * (1.0 - frac)
        return torch.where(s < float(warmup_steps), _warmup(s, peak, warmup_steps), decayed)

    return schedule
