"""Communication accounting: every collective records its kind, mesh axes and the bytes one
device sends by the ring formulas of docs/communication.md."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from functional_pp._torch import annotate, in_backward, is_tracing
from functional_pp.core.graph_tags import BACKWARD, TRACED
from functional_pp.core.runtime import per_thread

_local = per_thread("core.comm")


@dataclass(frozen=True)
class CommEvent:
    kind: str                 # all_reduce, all_gather, reduce_scatter, all_to_all, permute
    axes: tuple[str, ...]
    group_size: int
    bytes_sent: int           # per device
    shape: tuple[int, ...]    # local input shape
    dtype: str
    backward: bool            # issued while computing gradients


def ring_bytes(kind: str, numel_in: int, n: int, itemsize: int) -> int:
    """Bytes one device sends for a collective whose local input has ``numel_in`` elements."""
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1) * numel_in * itemsize // n
    if kind == "all_gather":           # input is the local block: (n-1)/n of the full tensor
        return (n - 1) * numel_in * itemsize
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) * numel_in * itemsize // n
    if kind == "permute":
        return numel_in * itemsize
    raise ValueError(kind)


class CommReport:
    """Collectives issued on this device while the report was active."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []

    def by_axis(self) -> dict[tuple[str, ...], dict[str, dict[str, int]]]:
        """``{axes: {kind: {"count": c, "bytes": b}}}``."""
        out: dict = {}
        for e in self.events:
            slot = out.setdefault(e.axes, {}).setdefault(e.kind, {"count": 0, "bytes": 0})
            slot["count"] += 1
            slot["bytes"] += e.bytes_sent
        return out

    def bytes(self, kind: str | None = None, axes: tuple[str, ...] | str | None = None,
              backward: bool | None = None) -> int:
        """Total bytes sent, optionally filtered by kind, exact mesh axes and pass."""
        if isinstance(axes, str):
            axes = (axes,)
        return sum(e.bytes_sent for e in self.events
                   if (kind is None or e.kind == kind) and (axes is None or e.axes == tuple(axes))
                   and (backward is None or e.backward == backward))

    def count(self, kind: str | None = None, axes=None) -> int:
        if isinstance(axes, str):
            axes = (axes,)
        return sum(1 for e in self.events
                   if (kind is None or e.kind == kind) and (axes is None or e.axes == tuple(axes)))

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes_sent for e in self.events)

    def as_dict(self) -> dict:
        return {"+".join(k) or "-": v for k, v in self.by_axis().items()}

    def table(self) -> str:
        """A readable table: one row per (mesh axes, kind)."""
        rows = [("mesh axes", "kind", "count", "bytes/device")]
        for axes, kinds in sorted(self.by_axis().items()):
            for kind, v in sorted(kinds.items()):
                rows.append(("+".join(axes), kind, str(v["count"]), f"{v['bytes']:,}"))
        rows.append(("total", "", str(len(self.events)), f"{self.total_bytes:,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@contextmanager
def comm_report() -> Iterator[CommReport]:
    """Record the collectives this device issues inside the block (eager execution)."""
    report = CommReport()
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(report)
    try:
        yield report
    finally:
        stack.remove(report)


def record(kind: str, axes: tuple[str, ...], n: int, x: torch.Tensor, backward: bool | None = None,
           nbytes: int | None = None) -> None:
    """Record one collective (``backward``: whether it belongs to the backward pass; by
    default, whether autograd is running a backward function now; ``nbytes``: the bytes this
    device sends when no ring formula gives them, as an uneven all-to-all's)."""
    stack = getattr(_local, "stack", None)
    if not stack or is_tracing():
        return
    sent = ring_bytes(kind, x.numel(), n, x.element_size()) if nbytes is None else int(nbytes)
    event = CommEvent(kind, tuple(axes), n, sent,
                      tuple(x.shape), str(x.dtype).replace("torch.", ""),
                      in_backward() if backward is None else backward)
    for report in stack:
        report.events.append(event)


@contextmanager
def recording(kind: str, axes: tuple[str, ...], n: int, x: torch.Tensor, sends: bool = True,
              backward: bool | None = None) -> Iterator[None]:
    """Around a collective: record it now (eager), or, under ``torch.compile``, tag the graph
    nodes it traces so each run of the compiled graph records it (:func:`replay`)."""
    if not is_tracing():
        if sends:
            record(kind, axes, n, x, backward)
        yield
        return
    nbytes = ring_bytes(kind, x.numel(), n, x.element_size()) if sends else 0
    meta = {TRACED: (kind, tuple(axes), n, nbytes, tuple(x.shape), str(x.dtype).replace("torch.", ""))}
    if in_backward():               # a transpose traced by torch.autograd.grad
        meta[BACKWARD] = True
    with annotate(meta):
        yield


def traced_events(tagged: list[tuple[tuple, bool]]) -> list[CommEvent]:
    """Events of a compiled graph from its collectives' tags and whether each runs in backward."""
    return [CommEvent(kind, axes, n, nbytes, shape, dtype, backward)
            for (kind, axes, n, nbytes, shape, dtype), backward in tagged if nbytes or kind != "permute"]


def replay(events: list[CommEvent]) -> None:
    """Record the collectives of one run of a compiled graph in the active reports."""
    stack = getattr(_local, "stack", None)
    if stack:
        for report in stack:
            report.events.extend(events)
