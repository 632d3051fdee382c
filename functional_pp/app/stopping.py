"""Axolotl's stopping rules, watched on the loss every device sees (the same on all of them, so
they stop at the same step): the loss watchdog (``loss_watchdog_threshold`` /
``loss_watchdog_patience``: that many steps in a row above the threshold) and early stopping
(``early_stopping_patience``: that many evaluations in a row without a lower held-out loss).
The run then saves its checkpoint and ends with :class:`StoppedEarly` (a non-zero exit
status, docs/bad_inputs.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["StoppedEarly", "Watch"]


class StoppedEarly(RuntimeError):
    """The run was stopped by the loss watchdog or by early stopping (its checkpoint saved)."""


@dataclass
class Watch:
    """The stopping rules of one run; :meth:`loss` / :meth:`eval_loss` return why to stop, or None."""

    threshold: float | None = None
    patience: int = 3
    early_patience: int | None = None
    _high: int = 0
    _best: float | None = None
    _stale: int = 0

    @classmethod
    def of(cls, cfg: Any) -> "Watch":
        return cls(cfg.loss_watchdog_threshold, cfg.loss_watchdog_patience or 3, cfg.early_stopping_patience)

    def loss(self, step: int, loss: float) -> str | None:
        if self.threshold is None:
            return None
        self._high = self._high + 1 if loss > self.threshold else 0
        if self._high >= self.patience:
            return (f"loss watchdog: the loss was above loss_watchdog_threshold={self.threshold} for "
                    f"{self._high} steps in a row (loss_watchdog_patience={self.patience}; step "
                    f"{step}: {loss:.4f}); training stopped")
        return None

    def eval_loss(self, step: int, loss: float) -> str | None:
        if self.early_patience is None:
            return None
        if self._best is None or loss < self._best:
            self._best, self._stale = loss, 0
            return None
        self._stale += 1
        if self._stale >= self.early_patience:
            return (f"early stopping: the held-out loss did not improve on {self._best:.4f} for "
                    f"{self._stale} evaluations (early_stopping_patience={self.early_patience}; step "
                    f"{step}: {loss:.4f}); training stopped")
        return None
