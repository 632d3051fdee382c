"""The progress line of a training run: ``\\r``-updated on a terminal, one line per
``log_every`` steps otherwise (docs/finetune.md)."""
from __future__ import annotations

import math
import sys
import time
from typing import IO

__all__ = ["Progress"]


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """Plain-text progress: ``\\r``-updated on a terminal, one line per ``log_every`` steps
    otherwise; shows loss, held-out loss (once known), lr, gradient norm, tokens/s (smoothed),
    MFU (when the peak FLOP/s are known), ETA and elapsed time."""

    def __init__(self, total: int, start: int = 0, log_every: int = 10,
                 stream: IO[str] | None = None, tty: bool | None = None, width: int = 20):
        self.total, self.start, self.log_every, self.width = total, start, log_every, width
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._t0: float | None = None
        self._s0 = start
        self._open = False
        self._tps: float | None = None          # exponential moving average of tokens/s
        self.eval_loss: float | None = None
        self._started = time.perf_counter()

    def line(self, step: int, metrics: dict, now: float | None = None) -> str:
        """The progress text after ``step``."""
        now = time.perf_counter() if now is None else now
        if self._t0 is None or step <= self._s0:
            eta = float("nan")
        else:   # time per step measured after the first step (compilation, warm-up)
            eta = (now - self._t0) / (step - self._s0) * (self.total - step)
        done = int(self.width * step / max(self.total, 1))
        bar = "#" * done + "." * (self.width - done)
        tps = self._tps if self._tps is not None else metrics.get("tokens_per_s_avg", float("nan"))
        parts = [f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {metrics['loss']:.4f}"]
        if self.eval_loss is not None:
            parts.append(f"eval {self.eval_loss:.4f}")
        if "reward" in metrics:          # GRPO: the generation's mean reward (docs/preference.md)
            parts.append(f"reward {metrics['reward']:.4g}")
        if "lr" in metrics:
            parts.append(f"lr {metrics['lr']:.2e}")
        if "grad_norm" in metrics:
            parts.append(f"gnorm {metrics['grad_norm']:.3g}")
        parts.append(f"{tps:,.0f} tok/s")
        if metrics.get("mfu_avg") is not None:
            parts.append(f"MFU {100 * metrics['mfu_avg']:.1f}%")
        parts.append(f"ETA {_fmt_time(eta)}")
        parts.append(f"{_fmt_time(now - self._started)} elapsed")
        return " | ".join(parts)

    def update(self, step: int, metrics: dict) -> None:
        now = time.perf_counter()
        if "eval_loss" in metrics:
            self.eval_loss = metrics["eval_loss"]
        tps = metrics.get("tokens_per_s_avg")
        if tps is not None and math.isfinite(tps) and step > self.start + 1:   # skip warm-up
            self._tps = tps if self._tps is None else 0.9 * self._tps + 0.1 * tps
        text = self.line(step, metrics, now)
        if self._t0 is None:
            self._t0, self._s0 = now, step
        if self.tty:
            self.stream.write("\r" + text + " " * 4)
            self._open = True
            if step >= self.total:
                self.stream.write("\n")
                self._open = False
        elif step % self.log_every == 0 or step >= self.total or step == self.start + 1:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a line without garbling the progress line."""
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()
