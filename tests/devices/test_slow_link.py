"""The artificially slow link of functional_pp/devices/slow_link.py (benchmarks/slow_link.py):
one collective at a time, latency plus bytes over bandwidth, configured from the environment
with a clear error; on gloo processes a synchronous collective takes at least the latency and
an asynchronous one is complete no earlier than its launch plus the latency."""
import time

import pytest
import torch

import functional_pp as fpp
from functional_pp.devices.slow_link import ENV_MBPS, ENV_MS, SlowLink, from_env


def test_the_link_carries_one_collective_at_a_time():
    link = SlowLink(0.5, bandwidth=1000.0)                  # 0.5 s + bytes / (1000 bytes/s)
    t0 = time.monotonic()
    first = link.reserve("all_gather", 100, 2, 4)             # sends (2-1) * 100 * 4 = 400 bytes
    second = link.reserve("all_reduce", 10, 2, 4)             # 2 (2-1)/2 * 10 * 4 = 40 bytes
    assert first - t0 == pytest.approx(0.9, abs=0.05)
    assert second - first == pytest.approx(0.54, abs=1e-9)    # queued behind the first


def test_link_settings_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_MS, raising=False)
    monkeypatch.delenv(ENV_MBPS, raising=False)
    assert from_env() is None
    monkeypatch.setenv(ENV_MS, "20")
    link = from_env()
    assert link.latency_s == 0.02 and link.bandwidth is None
    monkeypatch.setenv(ENV_MBPS, "fast")
    with pytest.raises(ValueError, match="FPP_SLOW_LINK_MBPS='fast'.*numbers"):
        from_env()
    monkeypatch.setenv(ENV_MBPS, "-1")
    with pytest.raises(ValueError, match="bandwidth > 0"):
        from_env()


def _timings():
    from functional_pp.core.runtime import current_context
    backend = current_context().backend
    group = (0, 1)
    x = torch.ones(8)
    t0 = time.monotonic()
    backend.all_gather(x, 0, group)
    sync = time.monotonic() - t0
    t0 = time.monotonic()
    wait = backend.start_all_gather(x, group)
    launched = time.monotonic() - t0
    out = wait()
    async_done = time.monotonic() - t0
    return sync, launched, async_done, out.shape[0]


@pytest.mark.multiprocess
def test_gloo_collectives_are_delayed_by_the_link(monkeypatch):
    monkeypatch.setenv(ENV_MS, "300")
    for sync, launched, async_done, n in fpp.launch(_timings, fpp.Mesh(dp_shard=2), processes=True, timeout=120):
        assert n == 16
        assert sync >= 0.3                       # blocked until the link has carried it
        assert async_done >= 0.3                 # complete no earlier than launch + latency
        assert launched < async_done             # the launch itself returns before completion
