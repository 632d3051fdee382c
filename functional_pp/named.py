"""Named arrays: a local block plus the names of its dimensions and its layout type.

For every mesh axis a named array is, in the terms of JAX's varying/invariant types:
  * split over it along one dimension (it varies over the axis),
  * varying over it without a split (e.g. a gathered weight, or a pvary'd value),
  * partial over it: a pending sum (the local result of contracting a split dimension),
  * or invariant over it.
Ops reconcile the layouts of their operands by inserting collectives (docs/semantics.md); the
transposes of those collectives give every gradient its reduction exactly once.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from . import collectives as C
from .layout import Layout, Rules
from .mesh import Mesh
from .order import from_balanced, to_balanced
from .recompute import regather_region
from .runtime import Options, active_rules, configure, current_context, options  # noqa: F401 (re-exported)

_EMPTY: frozenset[str] = frozenset()
_TRIVIAL_MESH = Mesh()


def env() -> tuple[Mesh, Rules]:
    """The running device's mesh and the active rules. Outside any device, rules that split a
    dimension have no mesh to split it over: an error, not a silent one-device layout
    (docs/policy.md, "Outside a mesh")."""
    ctx = current_context(required=False)
    rules = active_rules(required=False) or Rules()
    if ctx is None:
        _require_no_split(rules)
        return _TRIVIAL_MESH, rules
    return ctx.mesh, rules


def _require_no_split(rules: Rules) -> None:
    split = {dim: axes for dim, axes in rules.table.items() if axes}
    if split:
        dim, axes = next(iter(split.items()))
        raise RuntimeError(f"the active rules split dimension {dim!r} over mesh axes {tuple(axes)}, but no "
                           f"mesh is running: call the op inside functional_pp.launch(fn, mesh) (or a "
                           f"shard_map), or leave use_rules(...) for a one-device run")


class Named:
    """A local block with named dimensions, a layout and a varying/partial type."""

    __slots__ = ("data", "dims", "split", "vary", "partial", "_cache", "gathered_from", "is_param", "tied")

    def __init__(self, data: torch.Tensor, dims: Sequence[str], split: Layout | None = None,
                 vary: Iterable[str] = (), partial: Iterable[str] = ()):
        dims = tuple(dims)
        if data.ndim != len(dims):
            raise ValueError(f"tensor of shape {tuple(data.shape)} has {data.ndim} dimensions but "
                             f"{len(dims)} names {dims}")
        if len(set(dims)) != len(dims):
            raise ValueError(f"dimension names must be unique, got {dims}")
        self.data = data
        self.dims = dims
        self.split = tuple(tuple(s) for s in split) if split is not None else ((),) * len(dims)
        used = frozenset(a for s in self.split for a in s)
        self.partial = frozenset(partial)
        self.vary = frozenset(vary) | used | self.partial
        self._cache: dict = {}
        self.gathered_from = None   # (shard, axes, dim, balanced order c or 1) when gathered (ops/regather.py)
        self.is_param = False       # parameters are re-gathered in backward (FSDP), activations not
        self.tied = False           # a parameter used at several sites: gathered once for all

    # ------------------------------------------------------------------ info
    @property
    def shape(self) -> dict[str, int]:
        """Global size of every dimension."""
        mesh, _ = env()
        return {d: n * (mesh.axis_size(s) if s else 1) for d, n, s in zip(self.dims, self.data.shape, self.split)}

    def size(self, dim: str) -> int:
        return self.shape[self._check_dim(dim, "size")]

    def _check_dim(self, dim: str, op: str) -> str:
        if dim not in self.dims:
            raise ValueError(f"{op}: dimension {dim!r} is not one of {self.dims}")
        return dim

    def __repr__(self) -> str:
        parts = [f"{d}={n}" + (f"/{'+'.join(s)}" if s else "") for d, n, s in zip(self.dims, self.shape.values(), self.split)]
        extra = "" if not (self.vary - {a for s in self.split for a in s}) else f", vary={sorted(self.vary)}"
        extra += "" if not self.partial else f", partial={sorted(self.partial)}"
        return f"Named({', '.join(parts)}{extra}, dtype={self.data.dtype})"

    # ------------------------------------------------------------- operators
    # + - * / (and their reflections) are attached by functional_pp.ops.elementwise, the layer
    # that defines them (docs/architecture.md).
    def __neg__(self): return self.map(torch.neg, linear=True)
    def __pow__(self, p): return self.map(lambda t: t ** p)

    def map(self, fn, linear: bool = False) -> "Named":
        """Apply an elementwise function to the local block (settles pending sums unless linear)."""
        x = self if linear else settle(self)
        return Named(fn(x.data), x.dims, x.split, x.vary, x.partial)

    def astype(self, dtype: torch.dtype) -> "Named":
        return self.map(lambda t: t.to(dtype), linear=True)

    def value(self) -> torch.Tensor:
        """The local block with pending sums completed."""
        return settle(self).data


# ----------------------------------------------------------------- relayout


def require_named(op: str, **operands) -> None:
    """Raise a TypeError naming ``op`` and the operand unless every operand is a :class:`Named`."""
    for name, x in operands.items():
        if not isinstance(x, Named):
            raise TypeError(f"{op}: {name} is a {type(x).__name__}, not a named array; wrap it "
                            f"with functional_pp.named(tensor, 'dim names') (a full tensor) or "
                            f"functional_pp.wrap(block, 'dim names') (this device's block)")


def settle(x: Named, target: Layout | None = None) -> Named:
    """Complete pending sums: psum_scatter onto a dimension whose ``target`` wants the axis,
    otherwise psum."""
    if not isinstance(x, Named):
        require_named("settle", value=x)
    if not x.partial:
        return x
    key = ("settle", target)
    if key in x._cache:
        return x._cache[key]
    data, split, vary = x.data, list(x.split), set(x.vary)
    remaining = set(x.partial)
    mesh, rules = env()
    for d, want in enumerate(target or ()):
        for j, a in enumerate(want):
            if a in remaining and tuple(want[:j]) == split[d] and data.shape[d] % mesh.shape[a] == 0:
                if j == 0 and rules.splits_balanced(x.dims[d], want):    # scatter in the dim's order
                    data = to_balanced(data, d, mesh.shape[a], x.dims[d])
                data = C.psum_scatter(data, a, scatter_dimension=d, tiled=True)
                split[d] = split[d] + (a,)
                remaining.discard(a)
    if remaining:
        axes = tuple(a for a in mesh.axis_names if a in remaining)
        data = C.psum(data, axes)
        vary -= remaining
    out = Named(data, x.dims, tuple(split), vary)
    x._cache[key] = out
    return out


def pvary(x: Named, axes: Iterable[str]) -> Named:
    """Cast ``x`` to varying over ``axes`` (identity forward, psum backward); cached per value
    so that one value used by several ops is reduced once in backward."""
    mesh = env()[0]
    axes = tuple(a for a in mesh.axis_names if a in set(axes) and a not in x.vary)
    if not axes:
        return x
    key = ("pvary", axes)
    if key not in x._cache:
        out = Named(C.pvary(x.data, axes), x.dims, x.split, x.vary | set(axes), x.partial)
        out.gathered_from, out.is_param, out.tied = x.gathered_from, x.is_param, x.tied
        x._cache[key] = out
    return x._cache[key]


def relayout(x: Named, target: Layout, op: str = "relayout") -> Named:
    """Change the splits of ``x`` to ``target`` (one entry per dimension): all-gather what is
    split but should not be (backward: reduce-scatter), slice what should be split (free).
    ``op`` names the operation in errors."""
    x = settle(x, target)
    target = tuple(tuple(t) for t in target)
    if x.split == target:
        return x
    key = ("relayout", target)
    if key in x._cache:
        return x._cache[key]
    data, split, vary = x.data, list(x.split), set(x.vary)
    mesh, rules = env()
    gathers = []
    # gather the axes beyond the common prefix (inner axes first: one collective per dim);
    # a load-balanced dimension gathered whole is put back in natural order (docs/layouts.md)
    for d, (have, want) in enumerate(zip(x.split, target)):
        k = 0
        while k < min(len(have), len(want)) and have[k] == want[k]:
            k += 1
        extra = have[k:]
        if extra:
            shard = data
            with regather_region(x.is_param and not options().keep_gathered):   # ZeRO-3 under compile
                data = C.all_gather(data, extra, axis=d, tiled=True)
            split[d] = have[:k]
            order = 1                       # the recipe replays the reorder (docs/layouts.md)
            if k == 0 and rules.splits_balanced(x.dims[d], have):
                order = mesh.shape[have[0]]
                data = from_balanced(data, d, order, x.dims[d])
            gathers.append((shard, extra, d, order))
    sliced = False
    for d, want in enumerate(target):
        extra = want[len(split[d]):]
        if not extra:
            continue
        sliced = True
        used_elsewhere = [a for dd, s in enumerate(split) if dd != d for a in s if a in extra]
        if used_elsewhere:
            raise ValueError(f"{op}: mesh axis {used_elsewhere[0]!r} cannot split dimension "
                             f"{x.dims[d]!r}; it already splits another dimension of {x.dims}")
        if not split[d] and rules.splits_balanced(x.dims[d], want):
            data = to_balanced(data, d, mesh.shape[extra[0]], x.dims[d])
        for a in extra:
            n = mesh.shape[a]
            if data.shape[d] % n:
                raise ValueError(f"dimension {x.dims[d]!r} of local size {data.shape[d]} cannot be split "
                                 f"over mesh axis {a!r} of size {n}")
            if a in vary:
                data = _slice_varying(data, a, d)
            else:
                data = C.split_invariant(data, a, d)
                vary.add(a)
            split[d] = split[d] + (a,)
    out = Named(data, x.dims, tuple(split), vary)
    out.is_param = x.is_param
    if ((x.is_param or options().regather_activations) and len(gathers) == 1 and data.requires_grad
            and not sliced):
        out.gathered_from = gathers[0]    # lets ops re-gather in backward instead of saving it
    # a cached gathered weight stays alive as long as x (FSDP memory): only for tied parameters,
    # whose use sites share one gather (docs/layouts.md)
    if not (x.is_param and gathers) or x.tied:
        x._cache[key] = out
    return out


class _SliceVarying(torch.autograd.Function):
    """This device's slice of a value that varies (unsplit) over the axis; backward pads with zeros."""

    @staticmethod
    def forward(x, axis, dim):
        return C._local_chunk(x, axis, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axis, ctx.dim, ctx.full = inputs[1], inputs[2], inputs[0].shape[inputs[2]]

    @staticmethod
    def backward(ctx, g):
        n = C.axis_size(ctx.axis)
        i = C.axis_index(ctx.axis)
        size = ctx.full // n
        pad = [0, 0] * (g.ndim - ctx.dim - 1) + [i * size, ctx.full - (i + 1) * size]
        return torch.nn.functional.pad(g, pad), None, None


def _slice_varying(data: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    return _SliceVarying.apply(data, axis, dim)


def target_layout(dims: Sequence[str], shape: Sequence[int], name: str = "tensor") -> Layout:
    """Layout the rules give to a tensor with these dimension names and global sizes."""
    mesh, rules = env()
    return rules.resolve(dims, shape, mesh, name=name)




def varying_after(x: Named, target: Layout) -> set:
    """The axes ``x`` varies over once relayouted to ``target``."""
    return set(x.vary - x.partial) | {a for t in target for a in t} | {
        a for d, (have, want) in enumerate(zip(x.split, target)) for a in have}


def tied(x: Named) -> Named:
    """A parameter used at several sites (tied embeddings): every use of the returned value
    shares one FSDP all-gather in forward, one re-gather and one reduce-scatter in backward.
    Call it once per step and use the result at every site; the gathered weight lives from
    the first use until the result is dropped (the end of the forward)."""
    if not isinstance(x, Named):
        raise TypeError(f"tied: expected a named parameter, got {type(x).__name__}")
    y = Named(x.data, x.dims, x.split, x.vary, x.partial)
    y.is_param, y.gathered_from, y.tied = x.is_param, x.gathered_from, True
    return y


def wrap(data: torch.Tensor, dims: Sequence[str] | str, split: Layout | None = None) -> Named:
    """Wrap a local block as a named array with the given (or the rules') layout; its type
    varies over exactly the axes that split it."""
    if isinstance(dims, str):
        dims = dims.split()
    mesh, rules = env()
    if split is None:
        split = rules.resolve(dims, None, mesh)
    return Named(data, dims, split)


def named(data: torch.Tensor, dims: Sequence[str] | str) -> Named:
    """Wrap a FULL (replicated, invariant) tensor and take this device's block per the rules."""
    if isinstance(dims, str):
        dims = dims.split()
    x = Named(data, dims)
    return relayout(x, target_layout(x.dims, data.shape))

