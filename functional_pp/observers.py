"""Instrumentation as observers: low layers announce events, higher layers subscribe.

Today one event: a tensor saved for backward by an op's own saved-tensor hook (FSDP
re-gathering), which the planner counts to measure activation memory. Ops announce it with
:func:`saved_for_backward`; the planner subscribes with :func:`on_saved_for_backward`. The
collectives' counterpart is :mod:`functional_pp.comm` (docs/architecture.md)."""
from __future__ import annotations

from typing import Callable

import torch

_saved_observers: list[Callable[[torch.Tensor], None]] = []


def on_saved_for_backward(observer: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """Subscribe ``observer(tensor)`` to every tensor an op saves for backward through its own
    hook. Subscribing the same function twice has no effect; returns ``observer``."""
    if observer not in _saved_observers:
        _saved_observers.append(observer)
    return observer


def saved_for_backward(t: torch.Tensor) -> None:
    """Announce that ``t`` is saved for backward (calls every subscribed observer)."""
    for observer in _saved_observers:
        observer(t)
