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
import numbers
from typing import Any, Callable, Union

import torch

from functional_pp.optim.base import check_number

__all__ = [
    "Schedule",
    "check_steps",
    "check_end_value",
    "constant",
    "linear_warmup",
    "warmup_cosine_decay",
    "warmup_cosine_constant",
    "warmup_linear_decay",
]

StepLike = Union[int, float, torch.Tensor]
Schedule = Callable[[StepLike], torch.Tensor]


def check_steps(owner: str, name: str, value: Any) -> int:
    """``int(value)`` after checking it is a whole number of steps >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value != int(value) or value < 0:
        raise ValueError(f"{owner}: {name}={value!r} must be a whole number of steps >= 0")
    return int(value)


def check_peak(owner: str, peak: Any) -> float:
    """The peak learning rate: a finite number >= 0."""
    return check_number(owner, "peak", peak, low=0.0, hint=" (the learning rate after warmup, e.g. 3e-4)")


def check_end_value(owner: str, name: str, end_value: Any, peak: float) -> float:
    """The final learning rate of a decay: a finite number in [0, peak]."""
    v = check_number(owner, name, end_value, low=0.0, hint=" (the learning rate at the end of the decay)")
    if v > peak:
        raise ValueError(f"{owner}: {name}={end_value!r} is above the peak learning rate {peak!r}; the schedule "
                         f"would rise while decaying. Set it to at most the learning rate (usually 0 or ~10% of it)")
    return v


def _check_decay(owner: str, peak: Any, warmup_steps: Any, total_steps: Any, end_value: Any):
    """The checked arguments of a warmup-then-decay schedule."""
    peak = check_peak(owner, peak)
    warmup_steps = check_steps(owner, "warmup_steps", warmup_steps)
    total_steps = check_steps(owner, "total_steps", total_steps)
    if total_steps < warmup_steps:
        raise ValueError(f"{owner}: total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")
    return peak, warmup_steps, total_steps, check_end_value(owner, "end_value", end_value, peak)


def _as_step(step: StepLike) -> torch.Tensor:
    """Step as a float32 tensor (Python numbers are converted)."""
    if isinstance(step, torch.Tensor):
        return step.to(torch.float32)
    return torch.tensor(float(step), dtype=torch.float32)


def constant(value: float) -> Schedule:
    """``lr(step) = value``."""
    value = check_number("constant", "value", value, low=0.0, hint=" (a learning rate is a finite number >= 0)")

    def schedule(step: StepLike) -> torch.Tensor:
        return torch.full_like(_as_step(step), float(value))

    return schedule


def _warmup(s: torch.Tensor, peak: float, warmup_steps: int, power: int = 1) -> torch.Tensor:
    """``peak * min(step / warmup_steps, 1) ** power`` (power 2: Axolotl's ``lr_quadratic_warmup``)."""
    if warmup_steps <= 0:
        return torch.full_like(s, float(peak))
    return float(peak) * torch.clamp(s / float(warmup_steps), 0.0, 1.0) ** power


def linear_warmup(peak: float, warmup_steps: int) -> Schedule:
    """``peak * min(step / warmup_steps, 1)`` (constant ``peak`` afterwards)."""
    peak, warmup_steps = check_peak("linear_warmup", peak), check_steps("linear_warmup", "warmup_steps", warmup_steps)

    def schedule(step: StepLike) -> torch.Tensor:
        return _warmup(_as_step(step), peak, warmup_steps)

    return schedule


def _decay_fraction(s: torch.Tensor, warmup_steps: int, total_steps: int) -> torch.Tensor:
    """Fraction of the decay phase done, clamped to [0, 1]."""
    span = float(max(total_steps - warmup_steps, 1))
    return torch.clamp((s - float(warmup_steps)) / span, 0.0, 1.0)


def warmup_cosine_decay(peak: float, warmup_steps: int, total_steps: int, end_value: float = 0.0,
                        warmup_power: int = 1) -> Schedule:
    """Linear warmup to ``peak`` (``warmup_power=2``: quadratic, ``peak * (step / warmup) ** 2``,
    Axolotl's ``lr_quadratic_warmup``), then cosine decay to ``end_value`` at ``total_steps``.

    For ``warmup_steps <= step``:
    ``end + (peak - end) * 0.5 * (1 + cos(pi * (step - warmup) / (total - warmup)))``;
    ``end_value`` for ``step >= total_steps``.
    """
    peak, warmup_steps, total_steps, end_value = _check_decay("warmup_cosine_decay", peak, warmup_steps, total_steps, end_value)
    if warmup_power not in (1, 2):
        raise ValueError(f"warmup_cosine_decay: warmup_power must be 1 (linear) or 2 (quadratic), got {warmup_power!r}")

    def schedule(step: StepLike) -> torch.Tensor:
        s = _as_step(step)
        frac = _decay_fraction(s, warmup_steps, total_steps)
        decayed = float(end_value) + (float(peak) - float(end_value)) * 0.5 * (1.0 + torch.cos(math.pi * frac))
        return torch.where(s < float(warmup_steps), _warmup(s, peak, warmup_steps, warmup_power), decayed)

    return schedule


def warmup_cosine_constant(peak: float, warmup_steps: int, total_steps: int, constant_ratio: float,
                           end_value: float) -> Schedule:
    """Axolotl's ``cosine_constant_lr_ratio`` (its ``get_cosine_schedule_with_warmup_decay_constant``,
    after "Continual Pre-Training of LLMs: How to (re)warm your model?"): linear warmup to
    ``peak``, cosine decay to ``end_value`` over the steps up to ``C = int(total_steps *
    constant_ratio)``, then ``end_value`` held. For ``warmup_steps <= step``, with ``m = end_value
    / peak`` and ``p = (min(step, C) - warmup) / max(1, C - warmup)``:
    ``peak * (max(0, (1 - m) * 0.5 * (1 + cos(pi p))) + m)``."""
    peak, warmup_steps, total_steps, end_value = _check_decay("warmup_cosine_constant", peak, warmup_steps, total_steps,
                                                              end_value)
    constant_ratio = check_number("warmup_cosine_constant", "constant_ratio", constant_ratio, low=0.0,
                                  hint=" (the fraction of total_steps the cosine spans, between 0 and 1)")
    if constant_ratio > 1:
        raise ValueError(f"warmup_cosine_constant: constant_ratio must be between 0 and 1, got {constant_ratio}")
    n_cosine = int(total_steps * constant_ratio)
    m = float(end_value) / float(peak) if peak else 0.0

    def schedule(step: StepLike) -> torch.Tensor:
        s = _as_step(step)
        p = (torch.clamp(s, max=float(n_cosine)) - float(warmup_steps)) / float(max(1, n_cosine - warmup_steps))
        decayed = float(peak) * (torch.clamp((1.0 - m) * 0.5 * (1.0 + torch.cos(math.pi * p)), min=0.0) + m)
        return torch.where(s < float(warmup_steps), _warmup(s, peak, warmup_steps), decayed)

    return schedule


def warmup_linear_decay(peak: float, warmup_steps: int, total_steps: int, end_value: float = 0.0) -> Schedule:
    """Linear warmup to ``peak``, then linear decay to ``end_value`` at ``total_steps``.

    For ``warmup_steps <= step``:
    ``end + (peak - end) * (1 - (step - warmup) / (total - warmup))``, clamped.
    """
    peak, warmup_steps, total_steps, end_value = _check_decay("warmup_linear_decay", peak, warmup_steps, total_steps, end_value)

    def schedule(step: StepLike) -> torch.Tensor:
        s = _as_step(step)
        frac = _decay_fraction(s, warmup_steps, total_steps)
        decayed = float(end_value) + (float(peak) - float(end_value)) * (1.0 - frac)
        return torch.where(s < float(warmup_steps), _warmup(s, peak, warmup_steps), decayed)

    return schedule
