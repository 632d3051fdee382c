"""The training step's non-finite guard, in one place (docs/bad_inputs.md §2): which values a
step checks, and what the host does after the step's one metrics read: keep the old state of a
skipped step, stop with ``on_nonfinite="raise"`` or after ``max_consecutive_skips`` (with
deferred metrics the stops are checked per step at the read: step/deferred_metrics.py).

Mechanism: Optimizer update (the non-finite guard: keep, skip or raise).
"""
from __future__ import annotations

from typing import Any

import torch

from functional_pp.step.io import nonfinite_what


class NonFiniteError(FloatingPointError):
    """A step's loss, gradient norm or update is not finite (``on_nonfinite="raise"``), or too
    many consecutive steps were skipped (``max_consecutive_skips``)."""


def nonfinite_flags(loss_bad: torch.Tensor, grad_bad: torch.Tensor, update_ok: torch.Tensor | None = None) -> dict:
    """The step's 0-dim bool flags from its checks (whether the loss and the gradients' global
    norm are not finite, computed once by the update phase): ``nonfinite_loss``,
    ``nonfinite_grad`` (a NaN or inf gradient element makes the global norm non-finite, as does
    a norm beyond the dtype's range) and ``nonfinite_update`` (an update that is not finite or
    overflows the parameters; ``update_ok`` None: not checked, False)."""
    return {"nonfinite_loss": loss_bad, "nonfinite_grad": grad_bad,
            "nonfinite_update": torch.zeros_like(loss_bad) if update_ok is None else ~update_ok}


def keep_or_raise(metrics: dict, old: dict, params: Any, opt_state: Any, *, written: bool, on_nonfinite: str,
                  max_consecutive_skips: int | None) -> tuple[Any, Any, int]:
    """After the step's metrics read (Python numbers): the parameters and optimizer state to
    return and the run of consecutive skipped steps. A skipped step returns the old state
    ``old`` itself, except where the step ``written`` its result into that state: then the
    state was kept by the step's scalar guard (a non-finite loss or gradient), or, for an
    update found non-finite only after it was written (a compiled donated step of an optimizer
    without a pre-update bound, ``optim.update_bound``; one with a bound holds such a step and
    the host redoes it in new buffers), the run stops here with a :class:`NonFiniteError` (the
    state passed in was donated and now holds that update)."""
    skipped = bool(metrics["skipped"])
    run = int(metrics.get("consecutive_skips", 0)) + 1 if skipped else 0
    raise_if_stopping(metrics, run, written=written, on_nonfinite=on_nonfinite,
                      max_consecutive_skips=max_consecutive_skips)
    if skipped:
        params, opt_state = old["params"], old["opt_state"]
    return params, opt_state, run


def raise_if_stopping(metrics: dict, run: int, *, written: bool, on_nonfinite: str,
                      max_consecutive_skips: int | None) -> None:
    """Raise :class:`NonFiniteError` where a step read from the device (``metrics``: Python
    numbers, ``step`` the counter after it; ``run``: the consecutive skipped steps up to and
    including it) stops the run: an update found non-finite after it was ``written`` into a
    donated state, a skipped step with ``on_nonfinite="raise"``, or ``max_consecutive_skips``
    reached. Used after every step's read, and for each step of a deferred read in order
    (functional_pp/step/deferred_metrics.py), so the error names the step it is about."""
    skipped = bool(metrics["skipped"])
    step = int(metrics["step"]) - 1
    if skipped and written and metrics.get("nonfinite_update") and not (
            metrics.get("nonfinite_loss") or metrics.get("nonfinite_grad")):
        raise NonFiniteError(
            f"step {step}: the {nonfinite_what(metrics)} is not finite and was already written "
            f"into the donated state (train_step(donate_state=True) updates it in place, and this "
            f"optimizer has no pre-update bound, optim.update_bound, to hold such a step back); "
            f"training stopped. Resume from a checkpoint with a lower learning rate, or use "
            f"donate_state=False (or optim.adamw, which has a bound) to skip such steps")
    if skipped and on_nonfinite == "raise":
        raise NonFiniteError(f"step {step}: {nonfinite_what(metrics)} is not finite; "
                             f"training stopped (set on_nonfinite='skip' to skip such steps)")
    if max_consecutive_skips is not None and run >= max_consecutive_skips:
        raise NonFiniteError(
            f"step {step}: {run} consecutive steps were skipped because the "
            f"{nonfinite_what(metrics)} is not finite; training stopped (max_consecutive_skips="
            f"{max_consecutive_skips}). Lower the learning rate, check the data, or resume "
            f"from an earlier checkpoint")
