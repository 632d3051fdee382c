"""Gradient buckets: the data-parallel gradient all-reduces of one backward concatenated, per
(mesh group, reduce op, dtype), into buckets of ``bucket_mb`` megabytes, each launched as one
asynchronous all-reduce once it is full (docs/communication.md, "Buckets").

One policy, two forms side by side:

* ``eager.py``: buckets filled while autograd runs (``grad_buckets``, ``GradBuckets``);
* ``graph.py``: the pass that groups the all-reduces of a compiled step's graph the same way
  (``bucket_all_reduces``, run by the step's backend, functional_pp/parallel/step_backend.py);
* ``pending.py``: the placeholders of gradients still in flight (``PendingGrad``), shared with
  FSDP's asynchronous reduce-scatters, resolved before the optimizer.

The policy itself is :func:`bucket_capacity`: a bucket whose size reaches the capacity is
launched and the next one opened (0: one all-reduce per gradient; None: no buckets).

Mechanism: Gradient buckets (the bucket policy eager and compiled steps share).
"""
from __future__ import annotations

from functional_pp.core.policy import check_bucket_mb


def bucket_capacity(bucket_mb: float) -> int:
    """Bytes at which a bucket is full and launched (eager and compiled steps alike)."""
    check_bucket_mb(bucket_mb)
    return int(bucket_mb * 1024 * 1024)
