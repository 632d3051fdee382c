"""Deferred step metrics (docs/eager_overhead.md "Host synchronisation"): the steps of
``train_step(..., metrics="deferred")`` read nothing from the device. Each returns a
:class:`StepMetrics` whose values stay device tensors until one is asked for, or until
``step.read()``; then every pending step of this device is read in ONE transfer and the host
checks run for those steps in order (bad token ids, ``on_nonfinite="raise"``,
``max_consecutive_skips``, an update written non-finite, a held in-place update), so an error
names the first offending step, not the step of the read."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from functional_pp.ops.token_ids import TokenIdError, bad_id_message
from functional_pp.step.io import nonfinite_what, one_transfer, peak_memory
from functional_pp.step.nonfinite import NonFiniteError, raise_if_stopping

# a device keeps at most this many unread steps; the step that reaches it reads them (their
# 0-dim metrics and, eager, the token-id checks' views of their batches stay alive until read)
MAX_PENDING_STEPS = 256


class StepMetrics(Mapping):
    """One step's metrics (the keys of the per-step mode's dict). Asking for any value reads
    every pending step of the device in one transfer (:meth:`PendingSteps.read`). The read's
    error (the first failed host check) is raised by the access that made the read, and then by
    every access to the failing step's or a later step's values; earlier steps stay readable."""

    def __init__(self) -> None:
        self._values: dict | None = None
        self._error: BaseException | None = None
        self._window: PendingSteps | None = None

    def _read(self) -> dict:
        if self._values is None and self._error is None and self._window is not None:
            self._window.read()
        if self._error is not None:
            raise self._error
        if self._values is None:
            raise RuntimeError("these step metrics were never read (their read was interrupted)")
        return self._values

    @property
    def pending(self) -> bool:
        """Whether the values are still on the device (no read since the step)."""
        return self._values is None and self._error is None

    @property
    def error(self) -> BaseException | None:
        """The host check's error for this step or an earlier one of its read (reads first)."""
        try:
            self._read()
        except BaseException as exc:   # noqa: BLE001 (returned, not swallowed: the read raised it once)
            return exc
        return None

    def __getitem__(self, key: str) -> Any:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __reduce__(self):
        return dict, (dict(self._read()),)      # pickled (e.g. from a process launch) as its values

    def __repr__(self) -> str:
        if self.pending:
            return "StepMetrics(<on the device until read>)"
        return f"StepMetrics({self._values!r})" if self._error is None else f"StepMetrics(<{self._error!r}>)"


@dataclass
class _Step:
    keys: tuple[str, ...]
    scalars: list[torch.Tensor]     # the metrics (``keys``), then step, consecutive_skips, id flags
    id_checks: list
    written: bool
    started: float                  # time.perf_counter() when the step's call began
    metrics: StepMetrics


class PendingSteps:
    """The unread deferred steps of one device (one per device thread).

    ``host_values(metrics, seconds, window_steps)`` adds the host's figures of a step that took
    ``seconds``, the average of ``window_steps`` steps read together;
    ``on_nonfinite`` and ``max_consecutive_skips`` are the step's settings."""

    def __init__(self, host_values: Callable[[dict, float, int], None], *, on_nonfinite: str,
                 max_consecutive_skips: int | None):
        self.host_values = host_values
        self.on_nonfinite = on_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.steps: list[_Step] = []

    def add(self, m: dict, step: torch.Tensor, run: torch.Tensor, id_checks: list, *, written: bool,
            started: float) -> StepMetrics:
        """Keep a step's device metrics ``m``, its counter ``step`` (after it) and run of
        consecutive skips ``run``; returns its :class:`StepMetrics`. Reads nothing, unless the
        device already holds :data:`MAX_PENDING_STEPS` unread steps."""
        flags = [summary[0] for summary, _ in id_checks]
        out = StepMetrics()
        out._window = self
        self.steps.append(_Step(tuple(m), [*m.values(), step, run, *flags], list(id_checks), written,
                                started, out))
        if len(self.steps) >= MAX_PENDING_STEPS:
            self.read()
        return out

    def read(self) -> list[StepMetrics]:
        """Read every pending step in one transfer, fill their metrics and run the host checks in
        step order: the first failing one raises (:class:`~functional_pp.step.nonfinite.NonFiniteError`
        or :class:`~functional_pp.ops.token_ids.TokenIdError`, naming its step), and so does
        every later access to that step's or a later step's metrics."""
        steps, self.steps = self.steps, []
        if not steps:
            return []
        try:
            values = one_transfer([v for s in steps for v in s.scalars])
        except BaseException as exc:
            for s in steps:
                s.metrics._error = exc
            raise
        seconds = (time.perf_counter() - steps[0].started) / len(steps)
        peak = peak_memory(next((v.device for v in steps[0].scalars if isinstance(v, torch.Tensor)), None))
        error: BaseException | None = None
        held: list[int] = []
        at = 0
        for s in steps:
            row, at = values[at:at + len(s.scalars)], at + len(s.scalars)
            n = len(s.keys)
            metrics = dict(zip(s.keys, row[:n]))
            metrics["step"], metrics["consecutive_skips"] = int(row[n]), int(row[n + 1])
            if error is None:
                error = self._check(metrics, s, any(row[n + 2:]))
                if error is None and metrics.get("update_held"):
                    held.append(metrics["step"] - 1)
            if not metrics.get("update_held", 1):
                metrics.pop("update_held")     # as the per-step mode's metrics (which redo such steps)
            self.host_values(metrics, seconds, len(steps))
            metrics["peak_memory_bytes"] = peak
            if error is not None:
                s.metrics._error = error
            else:
                s.metrics._values = metrics
        if held:
            warnings.warn(f"step(s) {held}: the in-place optimizer update could not be shown finite before "
                          f"it was written, so it was held back and the step skipped (deferred metrics do "
                          f"not redo it in new buffers; metrics='per_step' does, docs/eager_overhead.md "
                          f"\"Host synchronisation\")", RuntimeWarning, stacklevel=2)
        if error is not None:
            raise error
        return [s.metrics for s in steps]

    def _check(self, metrics: dict, s: _Step, bad_ids: bool) -> BaseException | None:
        """The host checks of one step, read: its error, or None."""
        step = metrics["step"] - 1
        if bad_ids:
            message = bad_id_message(s.id_checks)     # a second transfer, for a failing step only
            return TokenIdError(f"step {step}: {message} (the step was skipped: its gradient was made non-finite)")
        if metrics.get("update_held") and self.on_nonfinite == "raise":
            return NonFiniteError(f"step {step}: the {nonfinite_what(metrics)} was skipped; training stopped "
                                  f"(on_nonfinite='raise'; metrics='per_step' redoes such updates in new "
                                  f"buffers)")
        try:
            raise_if_stopping(metrics, metrics["consecutive_skips"], written=s.written,
                              on_nonfinite=self.on_nonfinite, max_consecutive_skips=self.max_consecutive_skips)
        except NonFiniteError as exc:
            return exc
        return None

