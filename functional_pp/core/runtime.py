"""The ambient context, at the bottom of the package: which mesh, rank and communication
backend the running code belongs to, the active rules, and the ambient policy. Simulated devices
are threads, so all of it is thread-local. Every other layer reads it from here
(docs/architecture.md)."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, TypeVar

from functional_pp.core.mesh import Mesh
from functional_pp.core.policy import AMBIENT, RESOLVED, STEP_ONLY, Policy, check_keys

if TYPE_CHECKING:
    from functional_pp.core.layout import Rules

T = TypeVar("T")


@dataclass
class DeviceContext:
    mesh: Mesh
    rank: int
    backend: Any  # functional_pp.devices.Backend
    simulated: bool
    extras: dict = field(default_factory=dict)
    batched: bool = False     # one context for every device: launch(simulate="batched")

    @property
    def coords(self) -> dict[str, int]:
        return self.mesh.coords(self.rank)


# ------------------------------------------------------------------ per-thread state
# Simulated devices are threads, so what one device must not see of another is per thread.
# Every such store of the package is made here, under a name, so all of them can be listed
# in one place (per_thread_stores); tests/test_architecture.py refuses threading.local()
# anywhere else (_torch/ aside: it is below this module).
_STORES: dict[str, threading.local] = {}
_STORES_LOCK = threading.Lock()


def per_thread(name: str) -> threading.local:
    """The per-thread store called ``name`` (one per module, e.g. ``"parallel.fsdp.units"``; an
    object that needs its own gives its own name); made on first use, the same object after."""
    with _STORES_LOCK:
        store = _STORES.get(name)
        if store is None:
            store = _STORES[name] = threading.local()
        return store


def new_per_thread() -> threading.local:
    """A per-thread store of an object's own (its per-device state lives and dies with it: not
    named, not listed)."""
    return threading.local()


def per_thread_stores() -> dict[str, threading.local]:
    """Every per-thread store made so far, by name."""
    with _STORES_LOCK:
        return dict(_STORES)


_local = per_thread("core.runtime.device")
_process_context: DeviceContext | None = None
_rank_reads = per_thread("core.runtime.rank_reads")


def _read_rank(self: DeviceContext) -> int:
    counts = getattr(_rank_reads, "counts", None)
    if counts is not None:
        counts[0] += 1
    return self._rank


def _set_rank(self: DeviceContext, rank: int) -> None:
    self._rank = rank


# ``rank`` is a property, so that a trace that does not interpret the code (a natively traced
# step, step/native_trace.py) can tell whether what it traced depends on the device
DeviceContext.rank = property(_read_rank, _set_rank, doc="this device's index in the mesh")


@contextmanager
def counting_rank_reads() -> Iterator[list[int]]:
    """Count (in the list's one entry) the reads of a device context's ``rank`` on this thread
    inside the block."""
    previous = getattr(_rank_reads, "counts", None)
    _rank_reads.counts = counts = [0]
    try:
        yield counts
    finally:
        _rank_reads.counts = previous


def current_context(required: bool = True) -> DeviceContext | None:
    """The context of the device this code runs on."""
    ctx = _process_context or getattr(_local, "ctx", None)
    if ctx is None and required:
        raise RuntimeError(
            "No device context: this function communicates between devices and must run inside "
            "functional_pp.launch(fn, mesh) (simulated devices or torchrun)."
        )
    return ctx


def context_and_rules() -> "tuple[DeviceContext | None, Rules | None]":
    """The running device's context and the active rules, None where there is none: what
    :func:`current_context` and :func:`active_rules` read, without their checks (every op asks,
    docs/eager_overhead.md; a thread-local's ``__dict__.get``, not ``getattr``: a missing
    attribute would raise and catch)."""
    return _process_context or _local.__dict__.get("ctx"), _rules_local.__dict__.get("rules")


def current_mesh() -> Mesh:
    """The mesh of the running device."""
    return current_context().mesh


def current_rank() -> int:
    """This device's global rank in the running mesh (0 outside a launch)."""
    return current_context().rank


def device_coords() -> dict[str, int]:
    """This device's coordinate along every mesh axis."""
    return current_context().coords


@contextmanager
def thread_local_value(local: threading.local, name: str, value: T) -> Iterator[T]:
    """Set ``local.<name>`` to ``value`` on this thread for the block, then restore the previous
    value (the one mechanism behind the ambient context's ``with`` blocks)."""
    prev = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield value
    finally:
        setattr(local, name, prev)


def thread_context(ctx: DeviceContext | None) -> ContextManager[DeviceContext | None]:
    """Make ``ctx`` the running device of this thread for the block (None: no running device)."""
    return thread_local_value(_local, "ctx", ctx)


def set_process_context(ctx: DeviceContext | None) -> None:
    global _process_context
    _process_context = ctx


# ------------------------------------------------------------------------ active rules
_rules_local = per_thread("core.runtime.rules")


def use_rules(rules: "Rules") -> ContextManager["Rules"]:
    """Make ``rules`` the active rules for logical specs inside the block."""
    return thread_local_value(_rules_local, "rules", rules)


def active_rules(required: bool = True) -> "Rules | None":
    """The rules installed by :func:`use_rules` on this thread (None, or an error, if none)."""
    rules = getattr(_rules_local, "rules", None)
    if rules is None and required:
        raise RuntimeError("Logical specs need rules: pass rules= or use `with functional_pp.use_rules(rules):`")
    return rules


# ---------------------------------------------------------------------- the ambient policy
_policy_local = per_thread("core.runtime.policy")


def current_policy() -> Policy:
    """The policy in force on this thread, every ambient field resolved (:data:`RESOLVED`
    outside any :func:`use_policy` / :func:`configure` block)."""
    p = _policy_local.__dict__.get("value")     # (every op may read it: no getattr default dance)
    return RESOLVED if p is None else p


def use_policy(policy: Policy) -> ContextManager[Policy]:
    """Put ``policy`` in force on this thread for the block, its ambient fields left None taken
    from the policy in force (so :func:`current_policy` stays resolved); yields the policy
    installed."""
    if not isinstance(policy, Policy):
        raise TypeError(f"use_policy needs a functional_pp.Policy, got {type(policy).__name__}")
    return thread_local_value(_policy_local, "value", _over(policy, current_policy()))


_OVER: dict[tuple[int, int], tuple[Policy, Policy, Policy]] = {}
_OVER_SIZE = 64


def _over(policy: Policy, base: Policy) -> Policy:
    """``policy.over(base)``, the same object again for the same two policy objects (policies
    are frozen): a training step puts its policy, and its FSDP root's, over the same ambient
    one every step (a ``dataclasses.replace`` each, about 5 us). Holds the objects it was given
    (at most :data:`_OVER_SIZE` pairs), so an ``id`` is not reused while its entry lives."""
    key = (id(policy), id(base))
    hit = _OVER.get(key)
    if hit is not None and hit[0] is policy and hit[1] is base:
        return hit[2]
    resolved = policy.over(base)
    if len(_OVER) >= _OVER_SIZE:
        _OVER.clear()
    _OVER[key] = (policy, base, resolved)
    return resolved


def configure(**kw) -> ContextManager[Policy]:
    """Temporarily change the ambient policy of the ops: ``remat``, ``keep_gathered``,
    ``cp_attention``, ``regather_activations``, ``reduce_dtype`` (a :class:`Policy` built from
    ``kw``; the rest stays as it is). A training step's own policy overrides it where the step
    sets a field (docs/policy.md). Bucket and FSDP-unit settings belong to a step only."""
    step_only = [k for k in kw if k in STEP_ONLY]
    if step_only:
        raise TypeError(f"configure({step_only[0]}=...): {step_only[0]!r} is a setting of a training step only "
                        f"(gradient buckets, FSDP units); pass it to functional_pp.train_step(...) or "
                        f"TrainStep(policy=functional_pp.Policy({step_only[0]}=...)); configure takes "
                        f"{', '.join(AMBIENT)}")
    check_keys(kw, AMBIENT, "configure")
    return use_policy(Policy(**kw))
