"""One run per output directory (docs/bad_inputs.md §10): the main process holds an exclusive
``flock`` on ``OUTPUT_DIR/.functional-pp.lock`` from before it writes anything there until
:func:`~functional_pp.app.loop.train` returns. A second run on the same directory is refused
at once, naming the holder (pid, host, start time, command) as the file records it.

A lock left by a process that died is no lock: the kernel drops a ``flock`` with its process,
so a stale file (its pid gone, or the file only) never blocks a new run. The file itself is
kept (removing it would let two runs lock two different files)."""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from functional_pp.config import ConfigError

__all__ = ["RunLock", "RunLockedError", "LOCK_FILE"]

LOCK_FILE = ".functional-pp.lock"


class RunLockedError(ConfigError):
    """Another live run holds the output directory's lock (refused before any work: exit 2)."""


class RunLock:
    """The output directory's lock; :meth:`acquire` takes it (or raises :class:`RunLockedError`),
    :meth:`release` gives it back (also when never taken)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.path: Path | None = None

    def acquire(self, out_dir: Path) -> None:
        try:
            import fcntl
        except ImportError:                       # (no flock on this platform: no lock)
            return
        path = Path(out_dir) / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise RunLockedError(
                f"output_dir {out_dir} is in use by another run ({holder}); two runs in one directory "
                f"would overwrite each other's checkpoints and metrics. Wait for it to end or stop it, "
                f"or choose another directory (--output DIR / output_dir)") from None
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)                     # (closing drops the flock)
            self.fd = None


def _describe(raw: bytes) -> str:
    """The holder as the lock file records it."""
    try:
        info = json.loads(raw.decode())
        return (f"pid {info['pid']} on {info['host']}, started {info['started']}: "
                f"{info.get('command') or '?'}")
    except (ValueError, KeyError, UnicodeDecodeError):
        return "its lock file is being written"
