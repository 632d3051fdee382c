"""Progress of a long data preparation on stderr: silent while it is short, then a line with
the rows and tokens done and their rates at a bounded rate, and a last line when it ends. The
clock is an argument, so tests drive it without waiting."""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, TextIO

__all__ = ["Progress"]


def _default_stream() -> TextIO | None:
    """stderr on the first process (torchrun's RANK 0, or no torchrun); None on the others."""
    return sys.stderr if os.environ.get("RANK", "0") == "0" else None


class Progress:
    """``update(rows, tokens)`` with running totals; the first line is printed ``after`` seconds
    into the work, the next ones at least ``every`` seconds apart; ``finish()`` prints the totals
    if any line was printed (a short preparation prints nothing)."""

    def __init__(self, what: str, total_rows: int | None = None, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, after: float = 5.0, every: float = 10.0):
        self.what, self.total_rows = what, total_rows
        self.stream = _default_stream() if stream is None else stream
        self.clock, self.every = clock, every
        self.start = clock()
        self.next_at = self.start + after
        self.rows = self.tokens = 0
        self.lines = 0

    def update(self, rows: int, tokens: int) -> None:
        self.rows, self.tokens = rows, tokens
        if self.stream is None:
            return
        now = self.clock()
        if now >= self.next_at:
            self._print(now, "")
            self.next_at = now + self.every

    def finish(self) -> None:
        if self.lines and self.stream is not None:
            self._print(self.clock(), "done: ")

    def _print(self, now: float, prefix: str) -> None:
        seconds = max(now - self.start, 1e-9)
        of = f" of {self.total_rows:,}" if self.total_rows is not None else ""
        print(f"{self.what}: {prefix}{self.rows:,}{of} rows, {self.tokens:,} tokens in {seconds:.0f} s "
              f"({self.rows / seconds:,.0f} rows/s, {self.tokens / seconds:,.0f} tokens/s)",
              file=self.stream, flush=True)
        self.lines += 1
