"""``train_step(compile="per_layer")``: compile a model's declared layer function once and
reuse it for every layer (as torchtitan compiles per transformer block), so compile time does
not grow with depth (docs/compile.md, "Per-layer compilation").

The step itself runs eagerly; every call of an ``@fpp.layer`` function goes through one
``torch.compile`` of that function. Layers have the same shapes, so dynamo's guards match and
the first layer's graph serves all of them (a layer whose inputs differ, e.g. in layout,
gets its own graph, once). Autograd runs the compiled backward; with remat the compiled layer
is checkpointed eagerly (recomputed by calling the compiled forward again).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from functional_pp._torch import is_tracing
from functional_pp.compile.recompute import probe_backward_marks, reset_region_ids
from functional_pp.core.runtime import per_thread

PER_LAYER = "per_layer"

_local = per_thread("compile.layer_compile")


def split_mode(compile: bool | str) -> tuple[bool | str, bool | str]:
    """``(whole-step compile, per-layer compile)`` for a ``train_step(compile=...)`` value:
    ``"per_layer"`` (inductor) and ``"per_layer:<backend>"`` compile layers, not the step."""
    if isinstance(compile, str) and (compile == PER_LAYER or compile.startswith(PER_LAYER + ":")):
        backend = compile[len(PER_LAYER) + 1:] or True
        return False, backend
    return compile, False


@contextmanager
def compiled_layers(backend: Callable | str | None) -> Iterator[None]:
    """Inside the block (on this thread), declared layers run compiled with ``backend``."""
    prev = getattr(_local, "backend", None)
    _local.backend = backend
    try:
        yield
    finally:
        _local.backend = prev


def layer_backend() -> Callable | str | None:
    """The backend declared layers compile with on this thread, or None (run as written)."""
    if is_tracing():
        return None                         # inside a compiled step: part of its graph
    return getattr(_local, "backend", None)


class CompiledLayer:
    """One ``torch.compile`` of a layer function per backend, shared by all its calls."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._by_backend: dict = {}
        self._lock = threading.Lock()

    def get(self, backend: Callable | str) -> Callable[..., Any]:
        with self._lock:
            compiled = self._by_backend.get(backend)
            if compiled is None:
                probe_backward_marks()         # on the host, before the passes need it
                compiled = self._by_backend[backend] = torch.compile(
                    self.fn, backend=backend, fullgraph=True, dynamic=False)
            return compiled

    def active(self) -> Callable[..., Any] | None:
        """The compiled layer to run for a call now: the one for this thread's
        :func:`layer_backend`, with the regions numbered from 0 (the same guard state for
        every layer: one graph for all); None where layers run as written."""
        backend = layer_backend()
        if backend is None:
            return None
        body = self.get(backend)
        reset_region_ids()
        return body
