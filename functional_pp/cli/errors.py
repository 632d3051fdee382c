"""How the command line reports failures (docs/bad_inputs.md §7): one line on stderr and a
non-zero exit status; the traceback only with ``--debug``.

Exit statuses: 0 done, 1 runtime error (checkpoint, I/O, a failed device, a hang detected),
2 config or usage error (before any work), 3 training stopped on non-finite values,
4 stopped by the loss watchdog or early stopping (checkpoint saved), 130 interrupted (Ctrl-C; a
run stops at a step boundary with its checkpoint), 129 hung up (SIGHUP, as Ctrl-C), 143 stopped by
SIGTERM (as Ctrl-C)."""
from __future__ import annotations

import sys
import traceback
from typing import Callable

PROG = "functional-pp"
EXIT_ERROR, EXIT_CONFIG, EXIT_NONFINITE, EXIT_STOPPED, EXIT_INTERRUPTED = 1, 2, 3, 4, 130


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line: a device's traceback cut off, lines joined."""
    text = str(exc).split("\n--- traceback on device", 1)[0]
    parts = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(parts) or type(exc).__name__


def _root(exc: BaseException) -> BaseException:
    """The device's own exception inside a DeviceError."""
    return getattr(exc, "original", None) or exc


def exit_status(exc: BaseException) -> int:
    from functional_pp.app.signals import Interrupted
    from functional_pp.app.stopping import StoppedEarly
    from functional_pp.config import ConfigError
    from functional_pp.step.train import NonFiniteError
    root = _root(exc)
    if isinstance(root, StoppedEarly):
        return EXIT_STOPPED
    if isinstance(root, Interrupted):
        return root.status
    if isinstance(root, ConfigError) or isinstance(exc, ConfigError):
        return EXIT_CONFIG
    if isinstance(root, NonFiniteError):
        return EXIT_NONFINITE
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_ERROR


def run_reporting_errors(fn: Callable[[], int], *, debug: bool = False, stream=None) -> int:
    """Run ``fn`` (returns an exit status); turn an exception into one line on ``stream``
    (stderr) and its exit status, or re-raise it with ``debug``."""
    from functional_pp.config import ConfigError
    stream = stream or sys.stderr
    try:
        return fn()
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the command line's last word
        if debug:
            traceback.print_exc(file=stream)
        status = exit_status(exc)
        kind = "config error" if isinstance(exc, ConfigError) else "error"
        name = "" if isinstance(exc, ConfigError) else f"{type(exc).__name__}: "
        hint = "" if debug else " (run with --debug for the traceback)"
        print(f"{PROG}: {kind}: {name}{one_line(exc)}" + (hint if status == EXIT_ERROR else ""),
              file=stream, flush=True)
        return status
