"""Signals that stop a run without losing it (docs/bad_inputs.md §9): SIGTERM (a scheduler),
SIGINT (Ctrl-C) and SIGHUP (a closed terminal) all ask the training loop to stop at the next
step boundary, where every device agrees on the step, saves a checkpoint and ends with
:class:`Interrupted`: exit status 143 after SIGTERM (it used to be 0, so a ``train && export``
script or a scheduler took the stopped run for a finished one), 130 after SIGINT, 129 after SIGHUP.

A second signal while stopping changes nothing (the checkpoint being written is finished:
checkpoints are written to a temporary directory and renamed into place); a third SIGINT
aborts at once with status 130 and no new checkpoint (the ones already saved are whole).
Handlers are installed from the main thread only, and the old ones restored on exit."""
from __future__ import annotations

import os
import signal
import threading
from types import FrameType

__all__ = ["StopRequest", "Interrupted", "STOP_SIGNALS", "EXIT_STATUS"]

#: the signals that stop a run at a step boundary with a checkpoint
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n))
#: the command line's exit status after each: 128 + the signal number, as a shell reports it
EXIT_STATUS = {"SIGTERM": 143, "SIGINT": 130, "SIGHUP": 129}
#: signals after which a third one aborts without waiting for the step boundary
_ABORT_AFTER = 3


class Interrupted(RuntimeError):
    """The run was stopped by SIGTERM, SIGINT or SIGHUP at a step boundary, its checkpoint saved;
    ``status`` is the command line's exit status (143 / 130 / 129)."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.signal_name = signal_name
        self.status = EXIT_STATUS.get(signal_name, 130)


class StopRequest:
    """A flag set by the first stop signal (``signal``: its name); a context manager that
    installs the handlers (main thread only) and restores the old ones."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: str | None = None
        self.count = 0
        self._old: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        if self.signal is None:
            self.signal = name
            self.event.set()
            _say(f"received {name}: stopping at the next step boundary and saving a checkpoint "
                 f"(wait for it; a third Ctrl-C aborts without it)")
            return
        if name == "SIGINT" and self.count >= _ABORT_AFTER:
            _say(f"received {name} {self.count} times: aborting without a new checkpoint (the saved "
                 f"ones are whole)")
            os._exit(EXIT_STATUS["SIGINT"])
        _say(f"received {name} again: still stopping at the next step boundary; the checkpoint is "
             f"being saved (a third Ctrl-C aborts without it)")

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def _say(text: str) -> None:
    """One line on stderr, written directly (safe inside a signal handler)."""
    try:
        os.write(2, f"functional-pp: {text}\n".encode())
    except OSError:
        pass
