"""Named arrays: a local block plus the names of its dimensions and its layout type.

For every mesh axis a named array is, in the terms of JAX's varying/invariant types:
  * split over it along one dimension (it varies over the axis),
  * varying over it without a split (e.g. a gathered weight, or a pvary'd value),
  * partial over it: a pending sum (the local result of contracting a split dimension),
  * or invariant over it.
Ops reconcile the layouts of their operands by inserting collectives (docs/semantics.md); the
transposes of those collectives give every gradient its reduction exactly once.

A :class:`Named` is an immutable value (docs/named_value.md): everything about it is fixed
when it is built; memoised derived values (its settled or relayouted forms) live in a private
table (:func:`memo_table`) that is not part of the value.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Sequence

import optree
import torch

from functional_pp._torch import is_tracing
from functional_pp.core.layout import Layout, Rules
from functional_pp.core.mesh import Mesh
from functional_pp.core.order import to_balanced
from functional_pp.core.runtime import (active_rules, configure, context_and_rules,  # noqa: F401 (re-exported)
                                        current_context, current_policy, use_policy)
from functional_pp.devices.mesh_view import register_block_type
from functional_pp.parallel import collectives as C
from functional_pp.parallel.fsdp import param_uses
from functional_pp.parallel.fsdp.role import ParamRole, role as param_role, tied as tied_role

NO_AXES: frozenset[str] = frozenset()     # the ``vary`` / ``partial`` of a value over no mesh axis
_TRIVIAL_MESH = Mesh()
_NO_RULES = Rules()


def env() -> tuple[Mesh, Rules]:
    """The running device's mesh and the active rules. Outside any device, rules that split a
    dimension have no mesh to split it over: an error, not a silent one-device layout
    (docs/policy.md, "Outside a mesh")."""
    ctx, rules = context_and_rules()
    rules = rules or _NO_RULES
    if ctx is None:
        if rules is not _NO_RULES:
            _require_no_split(rules)
        return _TRIVIAL_MESH, rules
    return ctx.mesh, rules


_LAST_MESH = object()      # key of (mesh, plans) last used with a rules object


def op_env() -> tuple[Mesh, Rules, dict | None]:
    """:func:`env` for an op, plus the table of the op plans derived under these rules and mesh
    (eager; None while torch.compile traces: a memo would add guards to compiled code). Plans
    are keyed by what they depend on besides the rules and the mesh (docs/eager_overhead.md)."""
    ctx, rules = context_and_rules()
    rules = rules or _NO_RULES
    mesh = _TRIVIAL_MESH if ctx is None else ctx.mesh
    if is_tracing():
        if ctx is None and rules is not _NO_RULES:
            _require_no_split(rules)
        return mesh, rules, None
    side = memo_beside(rules)
    last = side.get(_LAST_MESH)
    if last is None or last[0] is not mesh:     # (the mesh object changes between launches only)
        if ctx is None and rules is not _NO_RULES:
            _require_no_split(rules)            # checked once per rules object outside a mesh
        last = side[_LAST_MESH] = (mesh, side.setdefault(("plans", mesh), {}))
    return mesh, rules, last[1]


def _require_no_split(rules: Rules) -> None:
    if not any(rules.table.values()):      # (called by every op outside a mesh: cheap when fine)
        return
    split = {dim: axes for dim, axes in rules.table.items() if axes}
    if split:
        dim, axes = next(iter(split.items()))
        raise RuntimeError(f"the active rules split dimension {dim!r} over mesh axes {tuple(axes)}, but no "
                           f"mesh is running: call the op inside functional_pp.launch(fn, mesh) (or a "
                           f"shard_map), or leave use_rules(...) for a one-device run")


def _global_sizes(shape: Sequence[int], split: Layout) -> tuple[int, ...] | None:
    """Global sizes from the local ``shape`` and the current mesh (None when the mesh does not
    know a splitting axis: then :attr:`Named.shape` asks the mesh current when it is read)."""
    if not any(split):
        return tuple(shape)
    mesh = env()[0]
    if not all(a in mesh.shape for s in split for a in s):
        return None
    return tuple(n * mesh.axis_size(s) if s else n for n, s in zip(shape, split))


class Named:
    """A local block with named dimensions, a layout and a varying/partial type.

    Immutable (docs/named_value.md): ``data`` (this device's block), ``dims`` (unique names),
    ``split`` (per dimension, the mesh axes splitting it, outer first), ``vary`` (the axes the
    value varies over: always a superset of the splitting and partial axes), ``partial`` (the
    axes of a pending sum) and the global sizes are fixed at construction, and so is its
    part in FSDP, one record owned by parallel/fsdp/role.py (``role``, None for an ordinary
    value): ``is_param`` (a parameter: FSDP re-gathers it in backward instead of saving it),
    ``tied`` (a parameter used at several sites, gathered once for all) and ``gathered_from``
    (``(shard, axes, dim, order)`` for a gathered parameter, so backward can re-gather it). Setting an
    attribute raises; :meth:`replace` returns a changed copy. Operations return new values.

    A pytree leaf in optree's default namespace, so ``tree_map`` over parameters hands over the
    named values; a node (its block the child) in the ``"functional_pp"`` namespace. A global
    node would silently turn every caller's named values into bare blocks (docs/named_value.md,
    "Pytrees")."""

    __slots__ = ("_data", "_dims", "_split", "_vary", "_partial", "_sizes", "_role", "_derived", "__weakref__")

    def __init__(self, data: torch.Tensor, dims: Sequence[str], split: Layout | None = None,
                 vary: Iterable[str] = (), partial: Iterable[str] = (), *, sizes: Sequence[int] | None = None,
                 is_param: bool = False, tied: bool = False, gathered_from: tuple | None = None):
        dims = tuple(dims)
        if data.ndim != len(dims):
            raise ValueError(f"tensor of shape {tuple(data.shape)} has {data.ndim} dimensions but "
                             f"{len(dims)} names {dims}")
        if len(set(dims)) != len(dims):
            raise ValueError(f"dimension names must be unique, got {dims}")
        split = tuple(tuple(s) for s in split) if split is not None else ((),) * len(dims)
        if len(split) != len(dims):
            raise ValueError(f"layout {split} needs one entry per dimension of {dims}")
        partial = frozenset(partial)
        vary = frozenset(vary).union(partial, *split)
        if sizes is not None and len(sizes) != len(dims):
            raise ValueError(f"sizes {tuple(sizes)} need one entry per dimension of {dims}")
        sizes = tuple(sizes) if sizes is not None else _global_sizes(data.shape, split)
        self._data, self._dims, self._split, self._vary, self._partial = data, dims, split, vary, partial
        self._sizes, self._role = sizes, param_role(is_param, tied, gathered_from)
        self._derived = None

    def replace(self, **changes) -> "Named":
        """A copy with some fields changed (``x.replace(is_param=True)``); layout fields are
        validated as by the constructor."""
        fields = dict(data=self.data, dims=self.dims, split=self.split, vary=self.vary, partial=self.partial,
                      is_param=self.is_param, tied=self.tied, gathered_from=self.gathered_from)
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"Named.replace: unknown field {sorted(unknown)[0]!r}; fields are {sorted(fields)}")
        if not ({"data", "dims", "split"} & set(changes)) or (
                "data" in changes and set(changes) <= {"data", "is_param", "tied", "gathered_from"}
                and tuple(changes["data"].shape) == tuple(self.data.shape)):
            changes.setdefault("sizes", self._sizes)
        fields.update(changes)
        return Named(**fields)

    # ------------------------------------------------------------------ info
    @property
    def shape(self) -> dict[str, int]:
        """Global size of every dimension."""
        sizes = self._sizes
        if sizes is None:      # built outside the mesh that splits it: ask the current one
            mesh = env()[0]
            sizes = [n * (mesh.axis_size(s) if s else 1) for n, s in zip(self.data.shape, self.split)]
        return dict(zip(self.dims, sizes))

    def size(self, dim: str) -> int:
        """Global size of ``dim``."""
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
        x = self if linear or not self._partial else settle(self)
        return make_named(fn(x._data), x._dims, x._split, x._vary, x._partial, x._sizes)

    def astype(self, dtype: torch.dtype) -> "Named":
        return self.map(lambda t: t.to(dtype), linear=True)

    def value(self) -> torch.Tensor:
        """The local block with pending sums completed."""
        return settle(self).data


def _refuse(name: str):
    def refuse(self, *value):
        raise AttributeError(f"Named is immutable: cannot set {name!r}; build a new value, e.g. "
                             f"x.replace({name}=...) (docs/named_value.md)")
    return refuse


# read-only fields (a plain getter per field: torch.compile traces these, not operator.attrgetter)
for _name, _get, _doc in (
        ("data", lambda self: self._data, "this device's block"),
        ("dims", lambda self: self._dims, "dimension names"),
        ("split", lambda self: self._split, "per dimension, the mesh axes splitting it"),
        ("vary", lambda self: self._vary, "mesh axes the value varies over (contains split and partial axes)"),
        ("partial", lambda self: self._partial, "mesh axes of a pending sum"),
        ("role", lambda self: self._role, "its part in FSDP (parallel/fsdp/role.py), None for an ordinary value"),
        ("is_param", lambda self: self._role is not None and self._role.is_param, "a parameter (FSDP re-gathers it)"),
        ("tied", lambda self: self._role is not None and self._role.tied, "a parameter used at several sites"),
        ("gathered_from", lambda self: None if self._role is None else self._role.gathered_from,
         "(shard, axes, dim, order) of a gathered parameter, else None")):
    setattr(Named, _name, property(_get, _refuse(_name), _refuse(_name), _doc))


def make_named(data: torch.Tensor, dims: tuple[str, ...], split: tuple[tuple[str, ...], ...], vary: frozenset,
               partial: frozenset = NO_AXES, sizes: tuple[int, ...] | None = None,
               role: ParamRole | None = None) -> Named:
    """The ops' constructor (part of the toolkit ops are written with, docs/named_value.md): no
    validation or conversion, so an op's result costs one object. The caller guarantees what
    :class:`Named` checks (tuples, frozensets, ``vary`` covering split and partial axes); a
    ``sizes`` of None is computed here; ``role``: its part in FSDP (parallel/fsdp/role.py).
    Outside an op, use :class:`Named` or :func:`wrap`."""
    if sizes is None:
        sizes = _global_sizes(data.shape, split)
    x = object.__new__(Named)
    x._data, x._dims, x._split, x._vary, x._partial = data, dims, split, vary, partial
    x._sizes, x._role = sizes, role
    x._derived = None
    return x


# Named is a pytree node in the "functional_pp" optree namespace (its block is the one child;
# the rest is metadata), e.g. optree.tree_map(f, tree, namespace="functional_pp") maps the
# blocks of a tree of named values. In the default namespace it stays a leaf, on purpose: see
# docs/named_value.md, "Pytrees".
optree.register_pytree_node(
    Named,
    lambda x: ((x.data,), (x.dims, x.split, x.vary, x.partial, x._sizes, x._role)),
    lambda meta, children: make_named(children[0], *meta),
    namespace="functional_pp")


# ------------------------------------------------------------------ memo tables
def memo_table(x: Named) -> dict:
    """Derived values of ``x`` (its settled, pvary'd, relayouted forms, the rotary tables of a
    positions value), kept while ``x`` lives so that one value used by several ops is converted
    (and reduced in backward) once. The table is not part of the value (docs/named_value.md):
    it sits in a private slot because torch.compile cannot trace an identity-keyed side table."""
    table = x._derived
    if table is None:
        table = x._derived = {}
    return table


_SIDE: dict[int, tuple[weakref.ref, dict]] = {}


def memo_beside(obj) -> dict:
    """A table of values derived from ``obj`` (e.g. einsum plans per rules object), kept beside
    it while it lives; eager only (callers skip it under torch.compile)."""
    key = id(obj)
    entry = _SIDE.get(key)
    if entry is not None and entry[0]() is obj:
        return entry[1]
    table: dict = {}

    def drop(ref, key=key):
        if _SIDE.get(key, (None,))[0] is ref:
            _SIDE.pop(key, None)
    _SIDE[key] = (weakref.ref(obj, drop), table)
    return table


# ---------------------------------------------------------- settle and pvary


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
    if not x._partial:
        return x
    key = ("settle", target)
    memo = memo_table(x)
    if key in memo:
        return memo[key]
    data, split, vary = x._data, list(x._split), set(x._vary)
    remaining = set(x._partial)
    mesh, rules = env()
    for d, want in enumerate(target or ()):
        for j, a in enumerate(want):
            if a in remaining and tuple(want[:j]) == split[d] and data.shape[d] % mesh.shape[a] == 0:
                if j == 0 and rules.splits_balanced(x._dims[d], want):    # scatter in the dim's order
                    data = to_balanced(data, d, mesh.shape[a], x._dims[d])
                data = C.psum_scatter(data, a, scatter_dimension=d, tiled=True)
                split[d] = split[d] + (a,)
                remaining.discard(a)
    if remaining:
        axes = tuple(a for a in mesh.axis_names if a in remaining)
        data = C.psum(data, axes)
        vary -= remaining
    out = make_named(data, x._dims, tuple(split), frozenset(vary), NO_AXES, x._sizes)
    memo[key] = out
    return out


def pvary(x: Named, axes: Iterable[str]) -> Named:
    """Cast ``x`` to varying over ``axes`` (identity forward, psum backward); cached per value
    so that one value used by several ops is reduced once in backward."""
    if not axes:
        return x
    wanted = set(axes)
    if wanted <= x._vary:
        return x
    mesh = env()[0]
    axes = tuple(a for a in mesh.axis_names if a in wanted and a not in x._vary)
    if not axes:
        return x
    key = ("pvary", axes)
    memo = memo_table(x)
    if key not in memo:
        memo[key] = make_named(C.pvary(x._data, axes), x._dims, x._split, x._vary.union(axes), x._partial, x._sizes,
                               x._role)
    return memo[key]


def target_layout(dims: Sequence[str], shape: Sequence[int], name: str = "tensor") -> Layout:
    """Layout the rules give to a tensor with these dimension names and global sizes."""
    mesh, rules = env()
    return rules.resolve(dims, shape, mesh, name=name)




def varying_after(x: Named, target: Layout) -> set:
    """The axes ``x`` varies over once relayouted to ``target``."""
    return set(x._vary - x._partial) | {a for t in target for a in t} | {
        a for d, (have, want) in enumerate(zip(x._split, target)) for a in have}


def tied(x: Named) -> Named:
    """A parameter used at several sites (tied embeddings): every use of the returned value
    shares one FSDP all-gather in forward, one re-gather and one reduce-scatter in backward.
    Call it once per step and use the result at every site; the gathered weight lives from
    the first use until the result is dropped (the end of the forward)."""
    if not isinstance(x, Named):
        raise TypeError(f"tied: expected a named parameter, got {type(x).__name__}")
    param_uses.declare_tied(x._data)
    return make_named(x._data, x._dims, x._split, x._vary, x._partial, x._sizes, tied_role(x._role))


def wrap(data: torch.Tensor, dims: Sequence[str] | str, split: Layout | None = None) -> Named:
    """Wrap a local block as a named array with the given (or the rules') layout; its type
    varies over exactly the axes that split it."""
    if isinstance(dims, str):
        dims = dims.split()
    if split is not None:
        env()
        return Named(data, dims, split)
    mesh, rules, plans = op_env()
    # eager: the names' layout, type and size factors derived (and validated) once per names
    key = ("wrap", tuple(dims))
    typed = None if plans is None else plans.get(key)
    if typed is None or data.ndim != len(typed[0]):
        x = Named(data, dims, rules.resolve(dims, None, mesh))
        if plans is not None and x._sizes is not None:
            plans[key] = (x._dims, x._split, x._vary, tuple(mesh.axis_size(a) if a else 1 for a in x._split))
        return x
    dims, split, vary, factors = typed
    return make_named(data, dims, split, vary, NO_AXES, tuple([n * f for n, f in zip(data.shape, factors)]))


def _with_block(x: Named, data: torch.Tensor) -> Named:
    """``x`` around another block of the same shape (a batched simulation stacks and splits the
    blocks of every device: devices/batched_run.py)."""
    return make_named(data, x.dims, x.split, x.vary, x.partial, x._sizes, x._role)


register_block_type(Named, lambda x: x.data, _with_block)
