"""``launch(..., processes=True)`` returns large results, tensors included, whole, and names
a process that dies without a result."""
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


def _killed_on_rank_1():
    import os
    import signal
    if fpp.current_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_process_killed_without_result_is_named():
    # undetected, this would end in a TimeoutError after 120 s instead
    with pytest.raises(fpp.DeviceError, match=r"device 1 .*killed by SIGKILL without reporting a result"):
        fpp.launch(_killed_on_rank_1, fpp.Mesh(dp_shard=2), processes=True, timeout=120)
