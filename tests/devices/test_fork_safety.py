"""A simulated launch leaves no OS thread behind, so a process forked right after it cannot
inherit a lock a dying device thread held (docs/real_processes.md)."""
import os
import threading

import pytest
import torch

import functional_pp as fpp


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_a_simulated_launch_returns_after_its_device_threads_are_gone():
    def device():
        x = torch.randn(64, 64)
        return threading.get_native_id(), float((x @ x).sum())

    for _ in range(3):
        results = fpp.launch(device, fpp.Mesh(dp_shard=4))
        tids = {tid for tid, _ in results}
        assert len(tids) == 4
        alive = [t for t in tids if os.path.exists(f"/proc/self/task/{t}")]
        assert not alive, f"device threads {alive} still exist after launch returned"
