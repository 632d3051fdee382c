"""The private PyTorch APIs functional_pp relies on, in one place, so a torch upgrade breaks
one module (tested in tests/test_torch_private.py). Functional collectives are used in
``backends/dist.py`` alone."""
from __future__ import annotations

import contextlib

import torch


def in_backward() -> bool:
    """Whether the autograd engine is running a backward function on this thread."""
    return torch._C._current_autograd_node() is not None


def compile_cache_limits(n_graphs: int):
    """Let torch.compile keep ``n_graphs`` graphs per function (dynamo's settings are
    thread-local: call it on the thread that compiles)."""
    import torch._dynamo.config as dcfg

    limits = {name: max(getattr(dcfg, name), n_graphs)
              for name in ("recompile_limit", "cache_size_limit") if hasattr(dcfg, name)}
    limits["accumulated_cache_size_limit"] = max(dcfg.accumulated_cache_size_limit, 8 * n_graphs)
    return dcfg.patch(**limits)


def trace_backward(enabled: bool = True):
    """Let dynamo trace ``torch.autograd.grad`` inside a compiled function (thread-local)."""
    if not enabled:
        return contextlib.nullcontext()
    import torch._dynamo.config as dcfg
    return dcfg.patch(trace_autograd_ops=True)
