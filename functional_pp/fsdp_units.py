"""FSDP units: the parameters of one model layer (``remat.layer``) all-gathered with one flat
all-gather per group of mesh axes when the layer starts, their gradients reduce-scattered with
one flat reduce-scatter, and, for backward, re-gathered with one flat all-gather
(docs/communication.md, "FSDP units").

Without units every parameter is gathered by the first op that needs it (one collective per
parameter and direction). A unit moves the same bytes in fewer, larger collectives; each
element is gathered, re-gathered and summed exactly as before, so the numbers do not change.
Active inside :func:`fsdp_units` (the training step, eager); compiled steps keep the
per-parameter collectives in the graph.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import optree
import torch

from . import comm
from .collectives import _group, raw_all_gather, raw_reduce_scatter
from .named import Named, configure, env, options, pvary
from .torch_private import is_tracing

_local = threading.local()


@contextmanager
def fsdp_units(enabled: bool = True, keep_root: bool = False) -> Iterator[None]:
    """Gather each layer's parameters as one unit inside the block (see the module docstring).
    ``keep_root``: weights used outside the layers (embedding, final norm, LM head) stay
    gathered from forward to backward instead of being re-gathered (FSDP2 keeps its root)."""
    previous = getattr(_local, "enabled", False), getattr(_local, "root_options", None)
    _local.enabled = enabled
    _local.last_unit = None
    try:
        if enabled and keep_root and not options().keep_gathered:
            with configure(keep_gathered=True) as root_options:
                _local.root_options = root_options
                yield
        else:
            _local.root_options = None
            yield
    finally:
        _local.enabled, _local.root_options = previous


def _keep_gathered() -> bool:
    """Whether the weights of a layer are kept for backward: the caller's ``keep_gathered``
    (or remat's), not the root's."""
    return options().keep_gathered and options() is not getattr(_local, "root_options", None)


def _data_axes() -> tuple[set[str], Any, Any]:
    mesh, rules = env()
    axes = {a for d in ("batch", "seq") for a in rules[d] if mesh.shape.get(a, 1) > 1}
    return axes, mesh, rules


def _plan(x: Any, data_axes: set[str], rules) -> tuple[int, int] | None:
    """(dim, k) when ``x`` is a parameter split along one dimension ``dim`` whose split from
    position ``k`` on is data-parallel axes (those the unit gathers); else None."""
    if not isinstance(x, Named) or not x.is_param or x.partial or x.tied or not x.data.requires_grad:
        return None
    found = [(d, s) for d, s in enumerate(x.split) if any(a in data_axes for a in s)]
    if len(found) != 1:
        return None
    d, s = found[0]
    k = next(i for i, a in enumerate(s) if a in data_axes)
    if any(a not in data_axes for a in s[k:]) or (k == 0 and rules.is_balanced(x.dims[d])):
        return None
    return d, k


class _Unit:
    """The parameters of one unit gathered over one group of mesh axes (one dtype)."""

    def __init__(self, axes: tuple[str, ...], dims: list[int], shards: list[torch.Tensor]):
        self.axes, self.dims = axes, dims
        self.shards = [s.detach() for s in shards]
        self.shapes = [s.shape for s in shards]
        self.numels = [s.numel() for s in shards]
        self.regathered: list[torch.Tensor] | None = None
        self.prev: _Unit | None = None       # the unit gathered before this one (backward: next)
        self._pending = None                 # waits for a launched re-gather
        self._done = False

    def flat(self) -> torch.Tensor:
        return torch.cat([s.reshape(-1) for s in self.shards])

    def unflatten(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Full parameters from the all-gathered flat shards (group-index-major blocks)."""
        total = sum(self.numels)
        n = gathered.numel() // total
        rows = gathered.view(n, total)
        out, offset = [], 0
        for shape, numel, dim in zip(self.shapes, self.numels, self.dims):
            pieces = [rows[r, offset:offset + numel].view(shape) for r in range(n)]
            out.append(torch.cat(pieces, dim=dim))
            offset += numel
        return out

    def start_regather(self) -> None:
        """Launch the backward re-gather (asynchronously where the backend can)."""
        if self.regathered is None and self._pending is None and not self._done:
            self._pending = _start_all_gather(self.flat(), self.axes)

    def regather(self) -> list[torch.Tensor]:
        """The full parameters again in backward: one flat all-gather, kept until the unit's
        gradients are reduce-scattered. Launching it also prefetches the unit backward
        reaches next (the one gathered before this one in forward)."""
        if self.regathered is None:
            self.start_regather()
            if self.prev is not None:
                self.prev.start_regather()
            wait, self._pending = self._pending, None
            self.regathered = self.unflatten(wait())
        return self.regathered

    def release(self) -> None:
        """The unit's backward is done: drop the re-gathered weights (waiting for a prefetch
        nobody used, so collectives stay matched)."""
        if self._pending is not None:
            self._pending()
            self._pending = None
        self.regathered, self._done = None, True


def _start_all_gather(flat: torch.Tensor, axes: tuple[str, ...]):
    """Launch an all-gather of ``flat`` along dim 0 over ``axes``; returns a function that
    waits for it. Backends without asynchronous collectives (simulated) gather at once."""
    ctx, axes, group = _group(axes, "all_gather")
    with comm.recording("all_gather", axes, len(group), flat):
        start = getattr(ctx.backend, "start_all_gather", None)
        if start is not None:
            return start(flat, group)
        out = ctx.backend.all_gather(flat, 0, group)
    return lambda: out


class _UnitGather(torch.autograd.Function):
    """One flat all-gather of a unit's shards; backward one flat reduce-scatter."""

    @staticmethod
    def forward(ctx, unit: _Unit, *shards: torch.Tensor):
        ctx.unit = unit
        return tuple(unit.unflatten(raw_all_gather(unit.flat(), unit.axes, 0)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        unit = ctx.unit
        unit.release()                       # every use of the re-gathered weights is done
        n = None
        chunks = []
        for g, dim in zip(grads, unit.dims):
            parts = g.chunk(g.shape[dim] // unit.shapes[len(chunks)][dim], dim=dim)
            n = len(parts)
            chunks.append(parts)
        send = torch.cat([chunks[i][r].reshape(-1) for r in range(n) for i in range(len(chunks))])
        flat = raw_reduce_scatter(send, unit.axes, 0)
        return (None, *[t.view(shape) for t, shape in zip(flat.split(unit.numels), unit.shapes)])


@contextmanager
def _regather_hooks(units: list[tuple[_Unit, list[torch.Tensor]]]) -> Iterator[None]:
    """Save a unit's gathered weights for backward as a reference to the unit (re-gathered
    there with one flat all-gather) instead of the full tensors (ops/regather.py per weight)."""
    def root(t: torch.Tensor) -> torch.Tensor:
        return t._base if t._base is not None else t

    where = {id(full): (weakref.ref(full), unit, i) for unit, fulls in units for i, full in enumerate(fulls)}

    def pack(t: torch.Tensor):
        hit = where.get(id(root(t)))
        if hit is not None and hit[0]() is root(t):
            _, unit, i = hit
            return ("fpp-unit", unit, i, tuple(t.shape), t.stride(), t.storage_offset())
        return t

    def unpack(p):
        if isinstance(p, tuple) and p[0] == "fpp-unit":
            _, unit, i, shape, stride, offset = p
            return unit.regather()[i].as_strided(shape, stride, offset)
        return p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def gather_unit(args: tuple) -> tuple[tuple, Any]:
    """``(args, context)``: the named parameters in ``args`` split over data-parallel axes
    replaced by their gathered values (one flat all-gather per group of axes and dtype), and
    the context to run the layer in (re-gather hooks). Unchanged outside :func:`fsdp_units`."""
    from contextlib import nullcontext
    if not getattr(_local, "enabled", False) or is_tracing() or not torch.is_grad_enabled():
        return args, nullcontext()
    data_axes, mesh, rules = _data_axes()
    leaves, spec = optree.tree_flatten(args, is_leaf=lambda x: isinstance(x, Named), none_is_leaf=False)
    # the weights meet activations varying over the data axes and over every axis that splits
    # the layer's inputs (sequence parallelism's tp): cast the shards (docs/communication.md)
    meets = set(data_axes) | {a for x in leaves if isinstance(x, Named) and not x.is_param
                              for s in x.split for a in s}
    groups: dict[tuple, list] = {}
    for i, x in enumerate(leaves):
        plan = _plan(x, data_axes, rules)
        if plan is None:
            continue
        d, k = plan
        axes = x.split[d][k:]
        # the gradient's sums over the other axes (HSDP's replicate, SP's tp) run on the shard
        x = pvary(x, meets - set(x.vary))
        groups.setdefault((axes, x.data.dtype), []).append((i, x, d, k))
    units = []
    for (axes, _), members in groups.items():
        unit = _Unit(axes, [d for _, _, d, _ in members], [x.data for _, x, _, _ in members])
        fulls = _UnitGather.apply(unit, *[x.data for _, x, _, _ in members])
        for (i, x, d, k), full in zip(members, fulls):
            split = list(x.split)
            split[d] = split[d][:k]
            y = Named(full, x.dims, tuple(split), x.vary, x.partial, is_param=True)
            leaves[i] = y
        units.append((unit, list(fulls)))
    if units and not _keep_gathered():             # re-gathered in backward: chain for prefetch
        for unit, _ in units:
            unit.prev, _local.last_unit = getattr(_local, "last_unit", None), unit
    return optree.tree_unflatten(spec, leaves), _layer_context(units)


@contextmanager
def _layer_context(units: list) -> Iterator[None]:
    keep = _keep_gathered()
    with configure(keep_gathered=keep):        # the root's setting does not reach the layer
        if units and not keep:
            with _regather_hooks(units):
                yield
        else:
            yield
