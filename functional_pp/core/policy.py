"""The execution policy in one object: what the ops save, communicate and recompute, and how a
training step groups its collectives, without changing the model or the numbers
(docs/policy.md).

A :class:`Policy` is frozen. Its *ambient* fields (:data:`AMBIENT`: ``remat``,
``keep_gathered``, ``cp_attention``, ``regather_activations``, ``reduce_dtype``, ``check_rep``) default to
None, "inherit": :meth:`Policy.over` fills them from another policy (the ambient one of
``core/runtime.py``, :func:`~functional_pp.core.runtime.current_policy`). Its *step* fields
(:data:`STEP_ONLY`: gradient buckets, FSDP units, collectives in flight, the compiled step's
overlap) have concrete defaults: only a training
step applies them, so there is nothing ambient to inherit (``bucket_mb=None`` means "no
buckets", not "inherit")."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import torch

DEFAULT_BUCKET_MB = 25.0
DEFAULT_IN_FLIGHT = 2
CP_ATTENTION = ("ring", "allgather")
#: what ``remat`` may be: False (keep every activation), True (recompute whole layers) or
#: "selective" (keep matrix products' and attention's results, recompute the rest) or
#: "selective_alternate" (torchtitan's op policy: the same, but every second matrix product recomputed)
SELECTIVE_REMAT = ("selective", "selective_alternate")
REMAT_MODES = (False, True, *SELECTIVE_REMAT)
# the fields an op reads from the ambient policy (functional_pp.configure sets them)
AMBIENT = ("remat", "keep_gathered", "cp_attention", "regather_activations", "reduce_dtype", "check_rep")
# the fields only a training step applies (fpp.train_step(...) / TrainStep(policy=...))
STEP_ONLY = ("bucket_mb", "fsdp_units", "fsdp_keep_root", "fsdp_prefetch", "collectives_in_flight", "overlap")


def check_bucket_mb(bucket_mb: float | None) -> None:
    """Refuse a bucket size that is not None or a number of megabytes >= 0."""
    if bucket_mb is None:
        return
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb >= 0:
        raise ValueError(f"bucket_mb must be a size in megabytes >= 0 (0: one all-reduce per gradient, "
                         f"launched as soon as backward produces it; None: unbucketed, synchronous), "
                         f"got {bucket_mb!r}")


def check_remat(remat: object, allow_none: bool = False) -> None:
    """Refuse a ``remat`` that is not one of :data:`REMAT_MODES` (or None, when inheriting)."""
    if remat is None and allow_none:
        return
    if not any(remat is m or (isinstance(m, str) and remat == m) for m in REMAT_MODES):
        raise ValueError(f"remat must be False, True, 'selective' (keep matmul and attention results, "
                         f"recompute the rest) or 'selective_alternate' (torchtitan's op policy: keep attention "
                         f"and every other matmul's result), got {remat!r}")


def check_keys(keys: Iterable[str], valid: Iterable[str], where: str) -> None:
    """Refuse a key of ``keys`` that is not in ``valid``, naming it and the valid ones."""
    valid = tuple(valid)
    unknown = [k for k in keys if k not in valid]
    if unknown:
        raise TypeError(f"{where}: unknown policy setting {unknown[0]!r}; the settings are "
                        f"{', '.join(valid)}")


@dataclass(frozen=True)
class Policy:
    """How the ops and the training step execute (docs/policy.md). None in an ambient field:
    inherit (:meth:`over`); :data:`RESOLVED` holds the values in force when nothing sets them."""

    remat: bool | str | None = None
    """Recompute each ``fpp.layer`` call in backward (activation checkpointing): True, or
    ``"selective"`` to keep the results of matrix products and attention, ``"selective_alternate"``
    to keep attention's and every other matrix product's (torchtitan's op policy; docs/memory.md)."""
    keep_gathered: bool | None = None
    """Keep FSDP-gathered weights for backward instead of re-gathering them (ZeRO-2 vs ZeRO-3)."""
    cp_attention: str | None = None
    """``"ring"`` (K/V travel by permutes) or ``"allgather"``: attention over a cp-split sequence."""
    regather_activations: bool | None = None
    """Save gathered activations' shards and re-gather them in backward (Megatron SP)."""
    reduce_dtype: torch.dtype | None = None
    """Sum 16-bit values in this dtype (mixed precision; a step sets it from its ``precision``)."""
    check_rep: bool | None = None
    """Check at run time that every ``shard_map`` output declared replicated is equal on all its
    devices (a debugging aid; ``shard_map(check_rep=...)`` decides for one function)."""
    bucket_mb: float | None = DEFAULT_BUCKET_MB
    """Step only: data-parallel gradient all-reduce buckets in MB (0: per gradient; None: unbucketed)."""
    fsdp_units: bool = True
    """Step only: under FSDP one flat all-gather / reduce-scatter per layer."""
    fsdp_keep_root: bool = True
    """Step only: under FSDP the weights outside the layers are not re-gathered in backward."""
    fsdp_prefetch: bool = True
    """Step only: under FSDP the next unit's gather is launched before a unit computes."""
    collectives_in_flight: int = DEFAULT_IN_FLIGHT
    """Step only: at most this many asynchronous collectives of one kind launched and not yet
    awaited, in eager FSDP units and compiled graphs alike (0: no bound; docs/communication.md)."""
    overlap: bool = True
    """Step only: a compiled step prefetches FSDP gathers and sinks waits to their first use
    (False: the trace's order, for debugging; parallel/fsdp/graph.py)."""

    def __post_init__(self):
        check_remat(self.remat, allow_none=True)
        if self.cp_attention not in (None, *CP_ATTENTION):
            raise ValueError(f"cp_attention {self.cp_attention!r}: choose 'ring' or 'allgather' (or None: "
                             f"the functional_pp.configure default)")
        if self.reduce_dtype is not None and not isinstance(self.reduce_dtype, torch.dtype):
            raise TypeError(f"reduce_dtype must be a torch.dtype or None, got {self.reduce_dtype!r}")
        check_bucket_mb(self.bucket_mb)
        n = self.collectives_in_flight
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"collectives_in_flight must be a whole number of collectives of one kind in flight "
                             f"at once (>= 1), or 0 for no bound (the default is {DEFAULT_IN_FLIGHT}), got {n!r}")

    @classmethod
    def of(cls, where: str = "Policy", **kw: Any) -> "Policy":
        """A policy from keyword settings, an unknown key refused with the valid ones named."""
        check_keys(kw, FIELDS, where)
        return cls(**kw)

    def replace(self, **kw: Any) -> "Policy":
        """This policy with the given fields changed (``dataclasses.replace``)."""
        check_keys(kw, FIELDS, "Policy.replace")
        return dataclasses.replace(self, **kw)

    def over(self, base: "Policy") -> "Policy":
        """This policy with each ambient field left None taken from ``base``."""
        missing = {k: getattr(base, k) for k in AMBIENT if getattr(self, k) is None and getattr(base, k) is not None}
        return dataclasses.replace(self, **missing) if missing else self


FIELDS = tuple(f.name for f in dataclasses.fields(Policy))
# the ambient values when nothing sets them (what current_policy() returns outside any block)
RESOLVED = Policy(remat=False, keep_gathered=False, cp_attention="ring", regather_activations=False,
                  check_rep=False)
