"""Values a loss function reports to the training step's metrics (docs/experts.md "In the
step metrics"): a model announces device tensors by name (:func:`report`, e.g. a mixture of
experts' tokens per expert), and the step that runs the loss collects them
(:func:`collecting`), combines them over its micro-batches and returns them with its other
metrics, read in the same one transfer (nothing is read from the device here).

Outside a collection :func:`report` does nothing and :func:`active` is False, so a model can
skip computing what nobody collects."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["report", "active", "collecting", "combine", "Collections", "COMBINES"]

#: how a value of several micro-batches combines: their sum (counts) or their mean (losses, ratios)
COMBINES = ("sum", "mean")



class Collections(threading.local):
    """Per thread (device), the open collections, innermost last: ``stack`` exists on every
    thread from its first use, so a compiled step's guards do not depend on whether a
    collection was ever opened there."""

    def __init__(self) -> None:
        self.stack: list = []


_store = Collections()


def active() -> bool:
    """Whether a step collects reported values on this device (thread)."""
    return bool(_store.stack)


def report(name: str, value: torch.Tensor, combine: str = "mean") -> None:
    """Report ``value`` (a device tensor, 0-dim or a vector; detached) as the metric ``name``
    of the running step; ``combine`` says how micro-batches combine it (:data:`COMBINES`).
    Reporting one name twice in a forward adds the values."""
    if combine not in COMBINES:
        raise ValueError(f"report({name!r}): combine {combine!r} is not one of {', '.join(COMBINES)}")
    if not _store.stack:
        return
    found = _store.stack[-1]
    value = value.detach()
    if name in found:
        old, how = found[name]
        if how != combine:
            raise ValueError(f"report({name!r}): reported with combine {how!r} and {combine!r}")
        value = old + value
    found[name] = (value, combine)


@contextmanager
def collecting() -> Iterator[dict[str, tuple[torch.Tensor, str]]]:
    """Collect the values reported inside: ``{name: (value, combine)}``."""
    stack = _store.stack
    found: dict[str, tuple[torch.Tensor, str]] = {}
    stack.append(found)
    try:
        yield found
    finally:
        stack.pop()          # (nested collections end in order; no comparison: traceable)


def combine(per_micro: list[dict[str, tuple[torch.Tensor, str]]]) -> dict[str, torch.Tensor]:
    """One value per name over the micro-batches' collections: summed or averaged as each
    was reported (a name missing from some micro-batches counts as zero there)."""
    out: dict[str, torch.Tensor] = {}
    how: dict[str, str] = {}
    for found in per_micro:
        for name, (value, c) in found.items():
            out[name] = value if name not in out else out[name] + value
            how[name] = c
    return {name: v / len(per_micro) if how[name] == "mean" and len(per_micro) > 1 else v
            for name, v in out.items()}
