"""Instrumentation as observers: low layers announce events, higher layers subscribe.

Three events: a tensor saved for backward by an op's own saved-tensor hook (FSDP
re-gathering), which the planner counts to measure activation memory (ops announce it with
:func:`saved_for_backward`; the planner subscribes with :func:`on_saved_for_backward`); and
work that depends on the device's position in the mesh (:func:`uneven_work`), which tells
the planner that one device does not stand for all (docs/planning.md); and a checkpointed
region running, first in forward and again when backward recomputes it (:func:`checkpointed`),
which tells the planner which layer the recomputation belongs to and that its collectives are
recomputation's; and work the devices of a mesh axis run one after another (:func:`serial_work`: the
blocks of a chain along a split sequence), which the planner's time model counts once per device. The
collectives'
counterpart is :mod:`functional_pp.core.comm` (docs/architecture.md)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import torch

_saved_observers: list[Callable[[torch.Tensor], None]] = []
_uneven_observers: list[Callable[[str, Mapping[str, int]], None]] = []
_region_observers: list[Callable[[object, bool, bool], None]] = []
_serial_observers: list[Callable[[int], None]] = []


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


def on_uneven_work(observer: Callable[[str, Mapping[str, int]], None]) -> Callable[[str, Mapping[str, int]], None]:
    """Subscribe ``observer(what, busiest)`` to announcements of uneven work; returns it."""
    if observer not in _uneven_observers:
        _uneven_observers.append(observer)
    return observer


def uneven_work(what: str, busiest: Mapping[str, int]) -> None:
    """Announce that this op's work depends on the device's coordinates (``what`` says how)
    and that the device at mesh coordinates ``busiest`` (e.g. ``{"cp": 3}``) does the most."""
    for observer in _uneven_observers:
        observer(what, dict(busiest))


def on_checkpointed(observer: Callable[[object, bool, bool], None]) -> Callable[[object, bool, bool], None]:
    """Subscribe ``observer(region, recompute, entering)`` to checkpointed regions entering and
    leaving (see :func:`checkpointed`); returns it."""
    if observer not in _region_observers:
        _region_observers.append(observer)
    return observer


@contextmanager
def checkpointed(region: object, recompute: bool) -> Iterator[None]:
    """Announce that the checkpointed region ``region`` (one object per call of the wrapped
    function) runs: in forward (``recompute=False``) or again in backward, recomputed."""
    for observer in _region_observers:
        observer(region, recompute, True)
    try:
        yield
    finally:
        for observer in reversed(_region_observers):
            observer(region, recompute, False)


def on_serial_work(observer: Callable[[int], None]) -> Callable[[int], None]:
    """Subscribe ``observer(devices)`` to serial work entering (``devices``, see :func:`serial_work`)
    and leaving (1); returns it."""
    if observer not in _serial_observers:
        _serial_observers.append(observer)
    return observer


@contextmanager
def serial_work(devices: int) -> Iterator[None]:
    """Announce that the block's work is this device's turn of a serial chain over ``devices`` devices
    (the other devices wait, then each does the like for its own part in turn): it takes ``devices``
    times its own time (ops/sequence_chain.py's blocks)."""
    for observer in _serial_observers:
        observer(devices)
    try:
        yield
    finally:
        for observer in reversed(_serial_observers):
            observer(1)
