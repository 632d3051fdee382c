"""How a training step's host side ends a step: the two metrics modes, one chosen when the step
is built (``train_step(metrics=...)``; docs/eager_overhead.md "Host synchronisation").

- :class:`PerStepMetrics`: each step reads its metrics (one transfer), runs the host checks
  (bad token ids, a held in-place update made again in new buffers, the non-finite guard's
  keep-or-raise) and returns Python numbers;
- :class:`DeferredMetrics`, the wrapper of the deferred mode: no step reads anything; a skipped
  step is chosen on the device (the old state selected, a bad token id made a non-finite loss),
  and the metrics stay device tensors (:class:`~functional_pp.step.deferred_metrics.StepMetrics`)
  until ``step.read()`` or first use.

Both are told the device function's :class:`~functional_pp.step.result.DeviceStepResult` and
return the new state and the metrics; the device function asks its mode for the two device-side
choices (:meth:`loss`, :meth:`chosen`).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from functional_pp.core.runtime import new_per_thread
from functional_pp.core.tree import tree_flatten, tree_leaves, tree_unflatten
from functional_pp.ops.token_ids import failed_flag, raise_if_bad
from functional_pp.step.buffers import device_of, select_finite
from functional_pp.step.deferred_metrics import PendingSteps, StepMetrics
from functional_pp.step.io import peak_memory, read_step_metrics
from functional_pp.step.nonfinite import keep_or_raise
from functional_pp.step.result import DeviceStepResult
from functional_pp.step.update import redo_held

__all__ = ["PerStepMetrics", "DeferredMetrics", "metrics_mode", "HostView"]


class HostView:
    """What a metrics mode needs of its step, given when the step is built: its settings
    (``on_nonfinite``, ``max_consecutive_skips``), ``host_values(metrics, seconds,
    window_steps)`` (the host's figures: tokens/s, MFU), ``compute_device()`` (where the step
    computes, for its peak memory) and ``redo(state, batch)`` (a held donated step made again
    without donation: its update strategy's ``redo``)."""

    def __init__(self, *, on_nonfinite: str, max_consecutive_skips: int | None,
                 host_values: Callable[..., None], compute_device: Callable[[], torch.device | None],
                 redo: Callable[[dict, dict], Any]):
        self.on_nonfinite, self.max_consecutive_skips = on_nonfinite, max_consecutive_skips
        self.host_values, self.compute_device, self.redo = host_values, compute_device, redo


class PerStepMetrics:
    """metrics="per_step": every step reads its metrics and chooses its state on the host."""

    deferred = False

    def __init__(self, host: HostView):
        self.host = host

    # the device side: nothing chosen there
    def loss(self, loss: torch.Tensor, checked_since: int) -> torch.Tensor:
        return loss

    def chosen(self, up: Any, old_params: list, old_opt_state: Any) -> tuple[Any, Any]:
        return up.params, up.opt_state

    # the host side
    def finish(self, state: dict, batch: dict, out: DeviceStepResult, id_checks: list,
               started: float) -> tuple[dict, dict, Any]:
        """The new state and the step's metrics (Python numbers), after the step's one read; and
        the bound's carried peaks of the state returned (None: unknown, read at the next step)."""
        host = self.host
        params, opt_state, step, skipped, m = out.params, out.opt_state, out.step, out.skipped, out.metrics
        written, peaks = out.written, out.peaks
        out = None
        if "consecutive_skips" in state:     # read with the metrics: one transfer
            m = {**m, "consecutive_skips": torch.as_tensor(state["consecutive_skips"])}
        metrics, bad_ids = read_step_metrics(m, step, id_checks)    # the step's one device-to-host read
        if bad_ids:
            raise_if_bad(id_checks)      # out-of-range token ids / labels (docs/bad_inputs.md §1)
        if metrics.pop("update_held", 0):     # rare: nothing written; run again without donation (docs/compile.md)
            params, opt_state, skipped, metrics = redo_held(host.redo(state, batch), state["skipped"], metrics)
            written, peaks = False, None     # (new buffers, or the old state: read at the next step)
        # the state to return, or a NonFiniteError: chosen after the one read (step/nonfinite.py)
        params, opt_state, run = keep_or_raise(metrics, state, params, opt_state, written=written,
                                               on_nonfinite=host.on_nonfinite,
                                               max_consecutive_skips=host.max_consecutive_skips)
        host.host_values(metrics, time.perf_counter() - started)
        metrics["peak_memory_bytes"] = peak_memory(host.compute_device() or device_of(params))
        previous = metrics.get("consecutive_skips")
        metrics["consecutive_skips"] = run
        return {"params": params, "opt_state": opt_state, "step": step, "skipped": skipped,
                "consecutive_skips": _run_tensor(run, previous, state.get("consecutive_skips"), step.device)}, \
            metrics, peaks

    def read(self) -> list[StepMetrics]:
        return []


class DeferredMetrics(PerStepMetrics):
    """metrics="deferred": a wrapper that keeps each step's metrics unread, per device thread,
    in a window of pending steps (:class:`~functional_pp.step.deferred_metrics.PendingSteps`)."""

    deferred = True

    def __init__(self, host: HostView):
        super().__init__(host)
        self._unread = new_per_thread()        # each device thread's PendingSteps

    def loss(self, loss: torch.Tensor, checked_since: int) -> torch.Tensor:
        """The loss divided by 0 where a token-id check of this micro-batch failed (by 1
        otherwise), so its gradient is not finite and reaches every device through the gradient
        reductions: the non-finite guard skips the step everywhere (the error is raised at the
        read; docs/bad_inputs.md §1)."""
        bad = failed_flag(checked_since)
        return loss if bad is None else loss / ~bad

    def chosen(self, up: Any, old_params: list, old_opt_state: Any) -> tuple[Any, Any]:
        """A state made in new buffers: the new parameters and optimizer state of ``up`` where the
        step is finite, else the old ones, selected on the device (``up``'s references are
        dropped first, so each new buffer is freed once its select is made). A state written in
        place is already the chosen one."""
        if up.written:
            return up.params, up.opt_state
        new_params, params_spec = tree_flatten(up.params)
        new_state, state_spec = tree_flatten(up.opt_state)
        new = [*new_params, *new_state]
        up.params = up.opt_state = new_params = new_state = None
        new = select_finite(up.finite, new, [*old_params, *tree_leaves(old_opt_state)])
        n = len(old_params)
        return tree_unflatten(params_spec, new[:n]), tree_unflatten(state_spec, new[n:])

    def finish(self, state: dict, batch: dict, out: DeviceStepResult, id_checks: list,
               started: float) -> tuple[dict, StepMetrics, Any]:
        """The new state (a skipped step's already chosen on the device) and the step's metrics
        kept unread; the run of skipped steps counted on the device."""
        m = out.metrics
        run = state.get("consecutive_skips")
        skip = m["skipped"]
        run = skip if run is None else (torch.as_tensor(run) + skip) * skip    # +1, or 0 after a taken step
        window = getattr(self._unread, "steps", None)
        if window is None:
            window = self._unread.steps = PendingSteps(self.host.host_values, on_nonfinite=self.host.on_nonfinite,
                                                       max_consecutive_skips=self.host.max_consecutive_skips)
        metrics = window.add(m, out.step, run, id_checks, written=out.written, started=started)
        return ({"params": out.params, "opt_state": out.opt_state, "step": out.step, "skipped": out.skipped,
                 "consecutive_skips": run}, metrics, out.peaks)

    def read(self) -> list[StepMetrics]:
        """This device's unread steps read in one transfer, their host checks run in order
        (raising for the first failing step: NonFiniteError, TokenIdError)."""
        window = getattr(self._unread, "steps", None)
        return window.read() if window is not None else []


def metrics_mode(mode: str, host: HostView) -> PerStepMetrics:
    """The metrics mode ``mode`` ("per_step" or "deferred") of a step, built with it."""
    return DeferredMetrics(host) if mode == "deferred" else PerStepMetrics(host)


def _run_tensor(run: int, previous: Any, old: Any, device: torch.device) -> torch.Tensor:
    """The state's ``consecutive_skips`` after a per-step read: the old tensor where the run did
    not change (every step of a run without skips: no host-to-device copy), else a new one on
    ``device``."""
    if run == previous and isinstance(old, torch.Tensor) and old.device == device:
        return old
    return torch.tensor(run, dtype=torch.int64, device=device)
