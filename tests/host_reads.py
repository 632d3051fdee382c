"""Counting the host's reads of device values (tests/step/test_eager_overhead.py,
tests/step/test_deferred_metrics.py)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Counts the aten ops that copy a tensor's value to the host (``.item()``, ``float()``,
    ``bool()``, ``int()`` all end in ``_local_scalar_dense``)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def transfers(monkeypatch):
    """Counts whole-tensor transfers to the host (``tolist``, ``numpy``), which do not dispatch."""
    seen = []
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            seen.append(_name)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen
