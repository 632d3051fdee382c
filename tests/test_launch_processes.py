"""``launch(..., processes=True)`` returns large results, tensors included, whole (dead or
stalled processes: tests/test_bad_inputs.py)."""
import pytest
import torch

import functional_pp as fpp

pytestmark = pytest.mark.multiprocess


def _large_result():
    return torch.full((1 << 20,), float(fpp.current_rank()))        # 4 MiB: many pipe buffers


def test_large_results_arrive_whole():
    out = fpp.launch(_large_result, fpp.Mesh(dp_shard=4), processes=True, timeout=300)
    assert [float(x[0]) for x in out] == [0.0, 1.0, 2.0, 3.0]
    assert all(x.numel() == 1 << 20 and torch.all(x == x[0]) for x in out)
