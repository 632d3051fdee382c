"""Layouts as data: estimate the communication and memory of a layout without running it,
and search the layouts of a device count for the cheapest one.

The model runs on simulated devices with meta tensors (shapes only, no memory, no FLOPs),
so every collective the real step would issue is counted exactly, and the tensors autograd
saves for backward are measured."""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from .comm import CommReport, comm_report
from .launch import launch
from .layout import Rules, local_shape
from .mesh import DEFAULT_AXES, Mesh
from .named import configure, wrap
from .observers import on_saved_for_backward
from .shard_map import use_rules
from .sharding import named_tree
from .tree import leaves_with_paths, map_with_path

_counter = threading.local()


@on_saved_for_backward
def count_saved(t: torch.Tensor) -> None:
    """Record a tensor saved for backward while planning (the planner's pack hook calls it; ops
    with their own hooks reach it as an observer, :mod:`functional_pp.observers`)."""
    seen = getattr(_counter, "seen", None)
    if seen is None:
        return
    base = t._base if t._base is not None else t
    if id(base) not in seen:
        seen[id(base)] = base.numel() * base.element_size()


@dataclass
class LayoutEstimate:
    mesh: Mesh
    rules: Rules
    comm: CommReport
    param_bytes: int          # this device's parameter shards
    state_bytes: int          # + gradients and Adam moments: ZeRO's 16 bytes per fp32 parameter
    activation_bytes: int     # tensors saved for backward, measured
    comm_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def comm_bytes(self) -> int:
        return self.comm.total_bytes

    @property
    def memory_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    def row(self) -> dict:
        return {"mesh": "x".join(f"{a}={s}" for a, s in self.mesh.shape.items() if s > 1) or "1 device",
                "comm_GB": self.comm_bytes / 1e9, "comm_s": self.comm_time_s,
                "state_GB": self.state_bytes / 1e9, "activations_GB": self.activation_bytes / 1e9,
                "memory_GB": self.memory_bytes / 1e9}


def estimate(loss_fn: Callable[[Any, dict], Any], decls: Any, mesh: Mesh, rules: Rules,
             batch: dict[str, tuple[Sequence[int], str]], *, options: dict | None = None,
             bandwidth: dict[str, float] | float | None = None) -> LayoutEstimate:
    """Communication and memory per device of one training step of ``loss_fn`` under
    ``mesh`` and ``rules``. ``batch`` gives each input's GLOBAL shape and dimension names,
    e.g. ``{"tokens": ((8, 4096), "batch seq"), "labels": ((8, 4096), "batch seq")}``.
    ``bandwidth`` (bytes/s, per mesh axis or one number) turns bytes into seconds."""
    rules.check(mesh)

    def device():
        with use_rules(rules), configure(**(options or {})):
            local = map_with_path(lambda p, d: torch.empty(
                local_shape(d.shape, rules.resolve(d.axes, d.shape, mesh, p), mesh),
                dtype=d.dtype, device="meta", requires_grad=d.dtype.is_floating_point), decls)
            named_batch = {}
            for key, (shape, dims) in batch.items():
                dims = dims.split() if isinstance(dims, str) else list(dims)
                layout = rules.resolve(dims, shape, mesh, name=f"batch[{key!r}]")
                named_batch[key] = wrap(torch.zeros(local_shape(shape, layout, mesh), dtype=torch.long,
                                                    device="meta"), dims, layout)
            _counter.seen = {}
            try:
                with comm_report() as rep, torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                    loss = loss_fn(named_tree(local, decls), named_batch).value()
                    saved = sum(_counter.seen.values())
                    _counter.seen = None
                    loss.backward()
            finally:
                _counter.seen = None
            params = sum(x.numel() * x.element_size() for _, x in leaves_with_paths(local))
            n = sum(x.numel() for _, x in leaves_with_paths(local))
        return rep, params, n, saved
    rep, param_bytes, n_local, saved = launch(device, mesh)[0]
    est = LayoutEstimate(mesh, rules, rep, param_bytes, 16 * n_local, saved)
    est.comm_time_s = _comm_time(rep, bandwidth)
    return est


def _pack(t: torch.Tensor):
    count_saved(t)
    return t


def _unpack(t):
    return t


def _comm_time(rep: CommReport, bandwidth) -> float:
    if bandwidth is None:
        return 0.0
    total = 0.0
    for e in rep.events:
        bw = bandwidth if isinstance(bandwidth, (int, float)) else min(bandwidth.get(a, float("inf")) for a in e.axes)
        total += e.bytes_sent / bw
    return total


def factorizations(n_devices: int, axes: Sequence[str] = DEFAULT_AXES) -> Iterable[Mesh]:
    """Every mesh of ``n_devices`` over ``axes`` (sizes are divisors, product is n)."""
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    for combo in itertools.product(divisors, repeat=len(axes)):
        p = 1
        for c in combo:
            p *= c
        if p == n_devices:
            yield Mesh.from_axes(list(zip(axes, combo)))


def search(loss_fn: Callable, decls: Any, n_devices: int, batch: dict, *,
           rules_for: Callable[[Mesh], Rules], meshes: Iterable[Mesh] | None = None,
           memory_limit_bytes: float | None = None, bandwidth=None, options: dict | None = None,
           ) -> list[LayoutEstimate]:
    """Estimate every candidate layout and rank them: those within ``memory_limit_bytes``
    first, by communication time (or bytes when no bandwidth is given), then memory. Layouts
    that do not divide the model or batch are skipped with the reason in ``notes``."""
    results, rejected = [], []
    for mesh in meshes if meshes is not None else factorizations(n_devices):
        try:
            results.append(estimate(loss_fn, decls, mesh, rules_for(mesh), batch, options=options,
                                    bandwidth=bandwidth))
        except Exception as exc:   # noqa: BLE001 - an impossible layout is a result, not a failure
            cause = getattr(exc, "original", exc)
            rejected.append((mesh, f"{type(cause).__name__}: {cause}".splitlines()[0]))

    def key(e: LayoutEstimate):
        over = memory_limit_bytes is not None and e.memory_bytes > memory_limit_bytes
        return (over, e.comm_time_s if bandwidth else e.comm_bytes, e.memory_bytes)
    results.sort(key=key)
    if results:
        results[0].notes.extend(f"skipped {m}: {why}" for m, why in rejected)
    return results


def table(estimates: Sequence[LayoutEstimate]) -> str:
    """A readable ranking."""
    rows = [e.row() for e in estimates]
    if not rows:
        return "(no layout fits)"
    head = f"{'mesh':<44} {'comm GB':>9} {'comm s':>8} {'state GB':>9} {'act GB':>8} {'mem GB':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['mesh']:<44} {r['comm_GB']:>9.3f} {r['comm_s']:>8.3f} {r['state_GB']:>9.3f} "
                     f"{r['activations_GB']:>8.3f} {r['memory_GB']:>8.3f}")
    return "\n".join(lines)
