"""FSDP units: the parameters of one model layer (``remat.layer``) all-gathered with one flat
all-gather per group of mesh axes when the layer starts, their gradients reduce-scattered with
one flat reduce-scatter, and, for backward, re-gathered with one flat all-gather
(docs/communication.md, "FSDP units").

The gather of the next unit is launched before a unit computes: in backward the re-gather of
the layer before, in forward the unit the last forward called next (``order.py``). A
unit's gradient reduce-scatter is launched asynchronously on real processes and awaited
before the optimizer (at most the step policy's ``collectives_in_flight`` in flight, docs/communication.md).
Without units every parameter is gathered by the first op that needs it (one collective per
parameter and direction). A unit moves the same bytes in fewer, larger collectives; each
element is gathered, re-gathered and summed exactly as before, so the numbers do not change.
Active inside :func:`fsdp_units` (the training step). A compiled step traces the same units
(:class:`_TracedUnitGather`: one flat all-gather in the graph, its backward the flat
reduce-scatter); prefetch, the backward re-gather and the in-flight bound are then the graph
passes' (``graph.py``, functional_pp/compile/recompute.py; docs/compile.md).

Mechanism: FSDP (per layer: one flat all-gather and reduce-scatter per `fpp.layer` call; eager).
"""
from __future__ import annotations

import math
import weakref
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterable, Iterator

import optree
import torch

from functional_pp._torch import in_backward, is_tracing
from functional_pp._torch.selective_checkpoint import outside_selective_checkpoint
from functional_pp.compile.recompute import traced_as_backward
from functional_pp.core import comm
from functional_pp.core.policy import DEFAULT_IN_FLIGHT, Policy
from functional_pp.core.runtime import per_thread, use_policy
from functional_pp.core.saved_hooks import pack_other, unpack_other
from functional_pp.parallel.fsdp import param_uses
from functional_pp.parallel.fsdp.graph import regather_region
from functional_pp.parallel.buckets.pending import PendingGrad, Slot
from functional_pp.parallel.collectives import _group, _reduce_dtype, raw_all_gather, raw_reduce_scatter
from functional_pp.parallel.fsdp.order import UnitOrder, trace
from functional_pp.parallel.named import Named, configure, current_policy, env, pvary

_local = per_thread("parallel.fsdp.units")


class UnitsSeen:
    """What a step's forward showed inside :func:`fsdp_units`: ``layered``, whether it called
    ``fpp.layer``; ``sharded``, whether a parameter it began with is split over a
    data-parallel axis (FSDP). Both are only ever set to True, never read, by traced code: a
    compiled graph replays the write, and no guard on a value that changes between calls
    (a counter) makes it compile again for each micro-batch or pipeline stage."""

    def __init__(self) -> None:
        self.layered = False
        self.sharded = False

    @property
    def root_without_layers(self) -> bool:
        """FSDP weights that were all root weights: the model declares no layer, so keeping the
        root gathered kept every weight gathered from forward to backward."""
        return self.sharded and not self.layered


_KEEP_ROOT = Policy(keep_gathered=True)    # the root's policy, put over the step's (runtime.use_policy)


@contextmanager
def fsdp_units(enabled: bool = True, keep_root: bool = False, prefetch: bool = True,
               order: UnitOrder | None = None, provisional_root: bool = False,
               data_dims: Iterable[str] | None = None,
               in_flight: int = DEFAULT_IN_FLIGHT) -> Iterator[UnitsSeen]:
    """Gather each layer's parameters as one unit inside the block (see the module docstring).
    ``keep_root``: weights used outside the layers (embedding, final norm, LM head) stay
    gathered from forward to backward instead of being re-gathered (FSDP2 keeps its root);
    ``provisional_root``: only from the forward's first layer call on (a step that does not
    know yet whether the model calls layers: without any, every weight is re-gathered in
    backward, ZeRO-3, from the first step). ``prefetch``: launch the next unit's gather
    before the current one computes, in backward and, with an ``order`` recorded by earlier
    forwards (:func:`begin_forward`), in forward. ``data_dims``: the dimension names of the
    step's batch (default ``batch``, ``seq``): the mesh axes the rules split them over are
    the data-parallel axes, whatever the model calls its dimensions. ``in_flight``: at most this
    many gradient reduce-scatters outstanding (0: no bound; the policy's ``collectives_in_flight``)."""
    previous = (getattr(_local, "enabled", False), getattr(_local, "root_policy", None),
                getattr(_local, "prefetch", True), getattr(_local, "order", None),
                getattr(_local, "seen", None), getattr(_local, "provisional_root", False),
                getattr(_local, "data_dims", None))
    _local.enabled, _local.prefetch, _local.order = enabled, prefetch, order
    _local.provisional_root = provisional_root
    _local.data_dims = tuple(data_dims) if data_dims is not None else None
    _local.seen = seen = UnitsSeen()
    _local.last_unit, _local.in_flight = None, []
    _local.in_flight_limit = in_flight
    try:
        if enabled and keep_root and not current_policy().keep_gathered:
            with use_policy(_KEEP_ROOT) as root_policy:     # (the same object every step over one policy)
                _local.root_policy = root_policy
                yield seen
        else:
            _local.root_policy = None
            yield seen
    except BaseException:
        _local.pending = None     # the step failed: do not wait for peers that may be gone
        raise
    finally:
        _drop_prefetch()
        _local.params = _local.index = None          # keep no parameters alive between steps
        _local.in_flight = []                        # (reduce-scatters are waited for by their gradients)
        (_local.enabled, _local.root_policy, _local.prefetch, _local.order, _local.seen,
         _local.provisional_root, _local.data_dims) = previous


def begin_forward(params: Any) -> None:
    """A forward of the step starts with the named parameters ``params``: unit calls are
    numbered from 0 and identified by the positions of their parameters in ``params``, so
    the next forward can prefetch them (functional_pp.parallel.fsdp.order)."""
    order = getattr(_local, "order", None)
    data_axes = _data_axes()[0]
    if not getattr(_local, "enabled", False) or order is None or not data_axes:
        return      # (no data-parallel axis: no unit is ever gathered)
    leaves = optree.tree_leaves(params, is_leaf=lambda x: isinstance(x, Named), none_is_leaf=False)
    seen = getattr(_local, "seen", None)
    if seen is not None and any(isinstance(x, Named) and x.is_param and any(
            a in data_axes for s in x.split for a in s) for x in leaves):
        seen.sharded = True   # (traced too: a compiled step without layers is told as an eager one)
    if is_tracing():
        return      # (compiled: the graph passes prefetch)
    _drop_prefetch()
    _local.params = [x.data if isinstance(x, Named) else x for x in leaves]
    _local.index = {id(t): i for i, t in enumerate(_local.params)}
    order.begin()


def _drop_prefetch() -> None:
    """Wait for a prefetched gather nobody used (so collectives stay matched) and forget it."""
    pending = getattr(_local, "pending", None)
    _local.pending = None
    if pending is not None:
        for _, wait in pending[1]:
            wait()


def _keep_gathered() -> bool:
    """Whether the weights of a layer are kept for backward: the caller's ``keep_gathered``
    (or remat's), not the root's."""
    policy = current_policy()
    return policy.keep_gathered and policy is not getattr(_local, "root_policy", None)


def keeps_gathered(policy) -> bool:
    """Whether the ``policy`` in force keeps a weight gathered from forward to backward: its
    ``keep_gathered``, except a provisional root's before the forward's first layer call
    (:func:`fsdp_units`), whose weights are re-gathered in backward (ZeRO-3)."""
    if not policy.keep_gathered:
        return False
    if policy is getattr(_local, "root_policy", None) and getattr(_local, "provisional_root", False):
        return _local.seen.layered
    return True


def _data_axes() -> tuple[set[str], Any, Any]:
    """The data-parallel mesh axes (of size > 1): those the rules split the batch's dimensions
    over (the step's ``batch_dims``; ``batch`` and ``seq`` outside a step)."""
    mesh, rules = env()
    names = getattr(_local, "data_dims", None) or ("batch", "seq")
    axes = {a for d in names for a in rules[d] if mesh.shape.get(a, 1) > 1}
    return axes, mesh, rules


def _plan(x: Any, data_axes: set[str], rules) -> tuple[int, int] | None:
    """(dim, k) when ``x`` is a parameter split along one dimension ``dim`` whose split from
    position ``k`` on is data-parallel axes (those the unit gathers); else None. A frozen
    parameter (no ``requires_grad``) is gathered too, in a unit of its own that autograd never
    reaches: no reduce-scatter (docs/adapters.md "Frozen parameters")."""
    if not isinstance(x, Named) or not x.is_param or x.partial or x.tied or not x.data.is_floating_point():
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
        self.incoming = None                 # forward: waits for the unit's launched gather
        self.prefetch = getattr(_local, "prefetch", True)   # backward: re-gather the next unit early
        self.call: int | None = None         # the unit's call in this forward (events, order.py)

    def flat(self) -> torch.Tensor:
        return torch.cat([s.reshape(-1) for s in self.shards])

    def unflatten(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        return unflatten_unit(gathered, self.shapes, self.numels, self.dims)

    def start_regather(self) -> None:
        """Launch the backward re-gather (asynchronously where the backend can)."""
        if self.regathered is None and self._pending is None and not self._done:
            self._pending = _start_all_gather(self.flat(), self.axes)

    def regather(self) -> list[torch.Tensor]:
        """The full parameters again in backward: one flat all-gather, kept until the unit's
        gradients are reduce-scattered. Launching it also prefetches the unit backward
        reaches next (the one gathered before this one in forward)."""
        if self.regathered is None:
            if self.call is not None:
                trace("backward", self.call)
            self.start_regather()
            if self.prev is not None and self.prefetch:
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


def unflatten_unit(gathered: torch.Tensor, shapes, numels, dims) -> list[torch.Tensor]:
    """Full parameters from a unit's all-gathered flat shards (group-index-major blocks: block
    r holds every member's shard r, in order)."""
    total = sum(numels)
    n = gathered.numel() // total
    rows = gathered.view(n, total)
    out, offset = [], 0
    for shape, numel, dim in zip(shapes, numels, dims):
        pieces = [rows[r, offset:offset + numel].view(shape) for r in range(n)]
        out.append(torch.cat(pieces, dim=dim))
        offset += numel
    return out


def pack_unit_gradients(grads, shapes, dims) -> torch.Tensor:
    """The flat buffer a unit's gradient reduce-scatter sends: for each group index r, every
    member's r-th block along its gathered dimension, in order (the layout of
    :func:`unflatten_unit`'s input)."""
    chunks = [g.chunk(g.shape[dim] // shape[dim], dim=dim) for g, shape, dim in zip(grads, shapes, dims)]
    n = len(chunks[0])
    return torch.cat([chunks[i][r].reshape(-1) for r in range(n) for i in range(len(chunks))])


class _TracedUnitGather(torch.autograd.Function):
    """A unit's gather inside a traced (compiled) step: the flat all-gather of eager's
    :class:`_UnitGather` as graph ops, its backward the same flat reduce-scatter. Prefetch, the
    backward re-gather and the in-flight bound are the graph passes' (compile/recompute.py,
    ``graph.py``)."""

    @staticmethod
    def forward(ctx, axes: tuple[str, ...], dims: tuple[int, ...], *shards: torch.Tensor):
        ctx.axes, ctx.dims, ctx.shapes = axes, dims, [s.shape for s in shards]
        flat = torch.cat([s.reshape(-1) for s in shards])
        return tuple(unflatten_unit(raw_all_gather(flat, axes, 0), ctx.shapes, [s.numel() for s in shards], dims))

    @staticmethod
    @traced_as_backward
    def backward(ctx, *grads: torch.Tensor):
        flat = raw_reduce_scatter(pack_unit_gradients(grads, ctx.shapes, ctx.dims), ctx.axes, 0)
        numels = [math.prod(shape) for shape in ctx.shapes]
        return (None, None, *[t.view(shape) for t, shape in zip(flat.split(numels), ctx.shapes)])


def _gather_traced(axes: tuple[str, ...], shards: list[torch.Tensor], dims: list[int]) -> list[torch.Tensor]:
    """A unit's gather in a compiled step, tagged so that the compiled backward gathers it again
    (ZeRO-3, functional_pp/compile/recompute.py) unless the layer keeps its weights gathered."""
    with regather_region(not _keep_gathered()):
        return list(_TracedUnitGather.apply(axes, tuple(dims), *shards))


def _start_all_gather(flat: torch.Tensor, axes: tuple[str, ...]):
    """Launch an all-gather of ``flat`` along dim 0 over ``axes``; returns a function that
    waits for it. Backends without asynchronous collectives (simulated) gather at once."""
    ctx, axes, group = _group(axes, "all_gather")
    # outside autograd (the gathered weights enter it through _UnitGather), launched and
    # awaited in the same grad mode: torch.distributed writes into views of the output
    with torch.no_grad(), comm.recording("all_gather", axes, len(group), flat):
        start = getattr(ctx.backend, "start_all_gather", None)
        if start is None:
            out = ctx.backend.all_gather(flat.detach(), 0, group)
            return lambda: out
        wait = start(flat.detach(), group)

    def waited() -> torch.Tensor:
        with torch.no_grad():
            return wait()
    return waited


class _UnitGather(torch.autograd.Function):
    """One flat all-gather of a unit's shards; backward one flat reduce-scatter."""

    @staticmethod
    def forward(ctx, unit: _Unit, *shards: torch.Tensor):
        ctx.unit = unit
        wait, unit.incoming = unit.incoming, None
        return tuple(unit.unflatten(wait()))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        unit = ctx.unit
        unit.release()                       # every use of the re-gathered weights is done
        send = pack_unit_gradients(grads, unit.shapes, unit.dims)
        if unit.prefetch:
            pending = _start_reduce_scatter(send, unit)
            if pending is not None:
                return (None, *pending)
        flat = raw_reduce_scatter(send, unit.axes, 0)
        return (None, *[t.view(shape) for t, shape in zip(flat.split(unit.numels), unit.shapes)])


class _ReduceScatter:
    """A unit's flat gradient reduce-scatter in flight (the source of its gradients' slots)."""

    def __init__(self, wait, device: torch.device, call: int | None):
        self._wait, self.device, self.call = wait, device, call
        self.flat: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        if self.flat is None:
            self.flat, self._wait = self._wait(), None       # the sent gradients are released
            if self.call is not None:
                trace("reduce_scatter_wait", self.call)
        return self.flat


def _start_reduce_scatter(send: torch.Tensor, unit: _Unit) -> list[PendingGrad] | None:
    """Launch the unit's flat gradient reduce-scatter asynchronously and return its gradients
    as placeholders (waited for before the optimizer, functional_pp.parallel.buckets.pending). Once
    the policy's ``collectives_in_flight`` (default 2) are outstanding the oldest is awaited at once:
    by default launching one waits for the one before, so a unit's full-size gradients live
    until the next unit's backward is done, as FSDP2 bounds them (docs/communication.md).
    None where the backend reduces at once (simulated devices)."""
    ctx, axes, group = _group(unit.axes, "psum_scatter")
    start = getattr(ctx.backend, "start_reduce_scatter", None)
    if start is None or len(group) == 1:
        return None
    wide = _reduce_dtype(send)
    y = send.to(wide) if wide else send
    with torch.no_grad(), comm.recording("reduce_scatter", axes, len(group), y, backward=True):
        source = _ReduceScatter(start(y, group), y.device, unit.call)
    if unit.call is not None:
        trace("reduce_scatter", unit.call)
    flight = _local.__dict__.setdefault("in_flight", [])
    flight.append(source)
    limit = getattr(_local, "in_flight_limit", DEFAULT_IN_FLIGHT)
    while limit and len(flight) >= limit:
        flight.pop(0).result()
    out, offset = [], 0
    for shape, numel in zip(unit.shapes, unit.numels):
        out.append(PendingGrad(Slot(source, offset, numel, shape, send.dtype)))
        offset += numel
    return out


@contextmanager
def _regather_hooks(units: list[tuple[_Unit, list[torch.Tensor]]]) -> Iterator[None]:
    """Save a unit's gathered weights for backward as a reference to the unit (re-gathered
    there with one flat all-gather) instead of the full tensors (parallel/fsdp/regather.py per weight)."""
    def root(t: torch.Tensor) -> torch.Tensor:
        return t._base if t._base is not None else t

    where = {id(full): (weakref.ref(full), unit, i) for unit, fulls in units for i, full in enumerate(fulls)}

    def pack(t: torch.Tensor):
        hit = where.get(id(root(t)))
        if hit is not None and hit[0]() is root(t):
            _, unit, i = hit
            return ("fpp-unit", unit, i, tuple(t.shape), t.stride(), t.storage_offset())
        return pack_other(t)              # (activation offloading, core/saved_hooks.py)

    def unpack(p):
        if isinstance(p, tuple) and p[0] == "fpp-unit":
            _, unit, i, shape, stride, offset = p
            return unit.regather()[i].as_strided(shape, stride, offset)
        return unpack_other(p)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def gathered_stand_in(x: Any) -> Any:
    """A zero, memory-free stand-in for the named parameter ``x`` as a unit gathers it (its
    data-parallel split undone), without communication: what a pipeline stage passes for the
    parameters it does not hold (functional_pp.step.pipeline). Other values unchanged."""
    data_axes, _, rules = _data_axes()
    plan = _plan(x, data_axes, rules) if data_axes else None
    if plan is None:
        return x
    d, k = plan
    n = 1
    for a in x.split[d][k:]:
        n *= env()[0].shape[a]
    shape = list(x.data.shape)
    shape[d] *= n
    split = list(x.split)
    split[d] = split[d][:k]
    return x.replace(data=torch.zeros((), dtype=x.data.dtype, device=x.data.device).expand(shape),
                     split=tuple(split))


def as_unit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a model's layer, ``functional_pp.layer``) called with its FSDP parameters
    gathered as one unit (:func:`gather_unit`) and run in the unit's context."""
    def unit(*args):
        # (unseen by selective checkpointing, which matches a recomputation to its forward by counting
        # ops: the forward takes the gathers the previous layer prefetched, the recomputation issues them)
        with outside_selective_checkpoint():
            args, context = gather_unit(args)
        with context:
            return fn(*args)
    unit.__qualname__ = getattr(fn, "__qualname__", unit.__qualname__)   # (errors name the model's layer)
    return unit


def gather_unit(args: tuple) -> tuple[tuple, Any]:
    """``(args, context)``: the named parameters in ``args`` split over data-parallel axes
    replaced by their gathered values (one flat all-gather per group of axes and dtype), and
    the context to run the layer in (re-gather hooks). In a step's forward the next unit's
    gather is launched before this one computes (forward prefetch, :func:`begin_forward`).
    Unchanged outside :func:`fsdp_units`."""
    if not getattr(_local, "enabled", False):
        return args, nullcontext()
    seen = getattr(_local, "seen", None)
    if seen is not None:
        seen.layered = True
    if not torch.is_grad_enabled():
        return args, nullcontext()
    tracing = is_tracing()
    data_axes, mesh, rules = _data_axes()
    if not data_axes:          # nothing is data-parallel: no parameter to gather (one device)
        return args, nullcontext()
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
        source = x.data
        param_uses.record(source)
        # the gradient's sums over the other axes (HSDP's replicate, SP's tp) run on the shard
        x = pvary(x, meets - set(x.vary))
        groups.setdefault((axes, x.data.dtype, x.data.requires_grad), []).append((i, x, d, k, source))
    if not groups:
        return args, nullcontext()
    if tracing:       # compiled: the same units; prefetch and re-gathers are the graph passes'
        for (axes, _, _), members in groups.items():
            fulls = _gather_traced(axes, [x.data for _, x, _, _, _ in members], [d for _, _, d, _, _ in members])
            for (i, x, d, k, _), full in zip(members, fulls):
                leaves[i] = _gathered(x, full, d, k)
        # (the root's keep_gathered reaches only weights the units leave to the ops: kept, not re-gathered)
        return optree.tree_unflatten(spec, leaves), nullcontext()
    call, incoming = _launch_gathers(groups)
    units = []
    for ((axes, _, _), members), wait in zip(groups.items(), incoming):
        unit = _Unit(axes, [d for _, _, d, _, _ in members], [x.data for _, x, _, _, _ in members])
        unit.incoming, unit.call = wait, call
        fulls = _UnitGather.apply(unit, *[x.data for _, x, _, _, _ in members])
        for (i, x, d, k, _), full in zip(members, fulls):
            leaves[i] = _gathered(x, full, d, k)
        units.append((unit, list(fulls)))
    frozen = [unit for ((_, _, trains), _), (unit, _) in zip(groups.items(), units) if not trains]
    if frozen and not _keep_gathered():
        units = _release_frozen_after_layer(leaves, frozen, units)
    if units and not _keep_gathered():             # re-gathered in backward: chain for prefetch
        for unit, _ in units:
            unit.prev, _local.last_unit = getattr(_local, "last_unit", None), unit
    return optree.tree_unflatten(spec, leaves), _layer_context(units, call)


def _gathered(x: Named, full: torch.Tensor, d: int, k: int) -> Named:
    """The parameter ``x`` gathered over the data-parallel axes of its dimension ``d`` (from
    position ``k`` of its split on)."""
    split = list(x.split)
    split[d] = split[d][:k]
    return Named(full, x.dims, tuple(split), x.vary, x.partial, is_param=True)


def _release_frozen_after_layer(leaves: list, frozen: list[_Unit], units: list) -> list:
    """Frozen units get no gradient, so no backward of theirs says when their re-gathered
    weights are done: the layer's activation inputs pass through :class:`_ReleaseUnits`, whose
    backward (reached once every op of the layer is done) releases them. Where no input needs
    a gradient the frozen weights are saved whole instead (left out of the re-gather hooks);
    returns the units to re-gather."""
    inputs = [i for i, x in enumerate(leaves) if isinstance(x, Named) and not x.is_param and x.data.requires_grad]
    if not inputs:
        return [(unit, fulls) for unit, fulls in units if unit not in frozen]
    outs = _ReleaseUnits.apply(frozen, *[leaves[i].data for i in inputs])
    for i, data in zip(inputs, outs):
        leaves[i] = leaves[i].replace(data=data)
    return units


class _ReleaseUnits(torch.autograd.Function):
    """Identity on a layer's activation inputs; backward releases the layer's frozen units."""

    @staticmethod
    def forward(ctx, frozen: list, *xs: torch.Tensor):
        ctx.frozen = frozen
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        for unit in ctx.frozen:
            unit.release()
        return (None, *grads)


def _launch_gathers(groups: dict) -> tuple[int | None, list]:
    """Issue this unit call's flat all-gathers (or take the ones prefetched for it), then
    launch the next call's as recorded by the last forward; returns the call's index in
    this forward (None outside a recorded forward) and a wait per group."""
    order = getattr(_local, "order", None)
    forward = order is not None and getattr(_local, "params", None) is not None and not in_backward()
    sources = [[src for _, _, _, _, src in members] for members in groups.values()]
    signature = None
    if forward:
        index = _local.index
        positions = [[index.get(id(t)) for t in srcs] for srcs in sources]
        if all(p is not None for ps in positions for p in ps):
            signature = tuple((axes, kind, tuple(ps), tuple(d for _, _, d, _, _ in members))
                              for ((axes, *kind), members), ps in zip(groups.items(), positions))
    pending, _local.pending = getattr(_local, "pending", None), None
    if pending is not None and pending[0] == signature:
        waits = [wait for _, wait in pending[1]]      # prefetched by the previous call
    else:
        if pending is not None:                       # the model changed: the prefetch is wasted
            _local.pending = pending
            _drop_prefetch()
        waits = [_start_all_gather(torch.cat([t.reshape(-1) for t in srcs]), axes)
                 for srcs, (axes, *_) in zip(sources, groups)]
    call = order.record(signature) if forward else None
    if call is not None:
        if pending is None or pending[0] != signature:
            trace("launch", call)
        nxt = order.expected(call + 1)
        if nxt is not None and _local.prefetch:
            params = _local.params
            launched = [(axes, _start_all_gather(torch.cat([params[p].reshape(-1) for p in ps]), axes))
                        for axes, _, ps, _ in nxt]
            _local.pending = (nxt, launched)
            trace("launch", call + 1)
    return call, [_traced_wait(wait, call) for wait in waits]


def _traced_wait(wait, call: int | None):
    if call is None:
        return wait

    def traced():
        out = wait()
        trace("wait", call)
        return out
    return traced


@contextmanager
def _layer_context(units: list, call: int | None = None) -> Iterator[None]:
    keep = _keep_gathered()
    if call is not None:
        trace("compute", call)
    with configure(keep_gathered=keep):        # the root's setting does not reach the layer
        if units and not keep:
            with _regather_hooks(units):
                yield
        else:
            yield
