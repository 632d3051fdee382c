"""The device context: which mesh, which rank and which communication backend the running
code belongs to. Simulated devices are threads, so the context is thread-local."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from .mesh import Mesh


@dataclass
class DeviceContext:
    mesh: Mesh
    rank: int
    backend: Any  # functional_pp.backends.Backend
    simulated: bool
    extras: dict = field(default_factory=dict)

    @property
    def coords(self) -> dict[str, int]:
        return self.mesh.coords(self.rank)


_local = threading.local()
_process_context: DeviceContext | None = None


def current_context(required: bool = True) -> DeviceContext | None:
    """The context of the device this code runs on."""
    ctx = _process_context or getattr(_local, "ctx", None)
    if ctx is None and required:
        raise RuntimeError(
            "No device context: this function communicates between devices and must run inside "
            "functional_pp.launch(fn, mesh) (simulated devices or torchrun)."
        )
    return ctx


def current_mesh() -> Mesh:
    """The mesh of the running device."""
    return current_context().mesh


def current_rank() -> int:
    return current_context().rank


def device_coords() -> dict[str, int]:
    """This device's coordinate along every mesh axis."""
    return current_context().coords


@contextmanager
def thread_context(ctx: DeviceContext) -> Iterator[DeviceContext]:
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


def set_process_context(ctx: DeviceContext | None) -> None:
    global _process_context
    _process_context = ctx
