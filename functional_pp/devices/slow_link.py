"""An artificially slow link for torch.distributed ranks, to measure how much communication
the step hides behind computation (benchmarks/slow_link.py, docs/real_processes.md).

``FPP_SLOW_LINK_MS=20`` (and optionally ``FPP_SLOW_LINK_MBPS=100``) in a rank's environment
makes every eager collective of :class:`~functional_pp.devices.dist.DistBackend` take at
least ``20 ms + bytes / (100 MB/s)`` (bytes sent by the device, ring formulas). The link
carries one collective at a time, in the order they are issued: a collective starts when
the link is free, and completes its duration later. A synchronous collective blocks the
rank until then; an asynchronous one (FSDP unit gathers and prefetches, gradient buckets)
only when its result is awaited, so computation in between hides the delay. Collectives
inside compiled graphs are not delayed.
"""
from __future__ import annotations

import os
import threading
import time

from functional_pp.core.comm import ring_bytes

ENV_MS, ENV_MBPS = "FPP_SLOW_LINK_MS", "FPP_SLOW_LINK_MBPS"


class SlowLink:
    """One link of ``latency_s`` per collective and ``bandwidth`` bytes/s (None: infinite)."""

    def __init__(self, latency_s: float, bandwidth: float | None = None):
        if not latency_s >= 0 or (bandwidth is not None and not bandwidth > 0):
            raise ValueError(f"slow link: latency must be >= 0 s and bandwidth > 0 bytes/s, got "
                             f"{latency_s!r} s and {bandwidth!r} bytes/s ({ENV_MS}, {ENV_MBPS})")
        self.latency_s, self.bandwidth = latency_s, bandwidth
        self._free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, kind: str, numel: int, n: int, element_size: int) -> float:
        """Queue one collective on the link now; the time (``time.monotonic``) it completes."""
        seconds = self.latency_s
        if self.bandwidth is not None:
            seconds += ring_bytes(kind, numel, n, element_size) / self.bandwidth
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + seconds
            return self._free_at

    @staticmethod
    def until(done_at: float) -> None:
        """Block until ``done_at`` (the collective's completion on the link)."""
        left = done_at - time.monotonic()
        if left > 0:
            time.sleep(left)


def from_env() -> SlowLink | None:
    """The link configured by ``FPP_SLOW_LINK_MS`` / ``FPP_SLOW_LINK_MBPS``, or None."""
    ms, mbps = os.environ.get(ENV_MS), os.environ.get(ENV_MBPS)
    if not ms and not mbps:
        return None
    try:
        latency = float(ms or 0) / 1000
        bandwidth = float(mbps) * 1e6 if mbps else None
    except ValueError:
        raise ValueError(f"{ENV_MS}={ms!r} / {ENV_MBPS}={mbps!r}: give numbers (milliseconds per collective, "
                         f"megabytes per second), e.g. {ENV_MS}=20") from None
    return SlowLink(latency, bandwidth)
