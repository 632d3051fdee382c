"""Layouts: which mesh axes split each dimension of a tensor, from rules or explicit specs."""
from __future__ import annotations

import difflib
import warnings
from typing import Iterable, Mapping, Sequence

from functional_pp._torch import is_tracing
from functional_pp.core.mesh import AxisNames, Mesh, as_axes

Layout = tuple[AxisNames, ...]  # per dimension, the mesh axes splitting it (major first)


class P(tuple):
    """A partition spec in mesh-axis terms: one entry per dimension, each None, an axis
    name or a tuple of axis names (like ``jax.sharding.PartitionSpec``)."""

    def __new__(cls, *entries):
        return super().__new__(cls, entries)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"


class inherit:
    """A derived logical name: laid out like ``parent`` (its mesh axes and its order), followed
    by ``extra`` mesh axes. ``Rules(seq="cp", res_seq=inherit("seq", "tp"))`` splits the
    residual stream's sequence like ``seq`` and further over ``tp`` (sequence parallelism).
    See docs/layouts.md."""

    def __init__(self, parent: str, *extra: str):
        self.parent, self.extra = parent, tuple(extra)

    def __repr__(self) -> str:
        return f"inherit({', '.join(repr(a) for a in (self.parent,) + self.extra)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, inherit) and (self.parent, self.extra) == (other.parent, other.extra)


class balanced:
    """A rule whose dimension is laid out load-balanced over its first mesh axis (c devices:
    device i holds chunks i and 2c-1-i of 2c), contiguous over the others; a split that does
    not start with that axis (it has size 1, or another dimension took it) is contiguous. The
    order causal attention wants for a sequence; every gather, slice, ``named()`` and loader
    follows it. ``Rules(seq=balanced("cp"))``. See docs/layouts.md."""

    def __init__(self, axes: str | Sequence[str]):
        self.axes = as_axes(axes)

    def __repr__(self) -> str:
        return f"balanced({self.axes!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, balanced) and self.axes == other.axes


class Rules:
    """Map dim names to ordered tuples of mesh axes.

    ``Rules(batch=("dp_replicate", "dp_shard"), seq=balanced("cp"), heads="tp", hidden="dp_shard",
    res_seq=inherit("seq"))``. A dim without a rule is never split. A split dimension
    is contiguous (device i holds block i) unless its rule is :class:`balanced`; a name given
    :class:`inherit` follows its parent's axes and order.
    """

    # Derived names that exist without being declared (the residual stream of the built-in
    # models); any other derived name is declared with inherit(...).
    DEFAULT_DERIVED = {"res_seq": ("seq", ())}

    def __init__(self, mapping: Mapping[str, str | Sequence[str] | None] | None = None, **rules):
        merged = dict(mapping or {})
        merged.update(rules)
        self.table: dict[str, AxisNames] = {}
        self.derived: dict[str, tuple[str, AxisNames]] = {}
        self.balanced_dims: set[str] = set()
        for logical, axes in merged.items():
            if isinstance(axes, inherit):
                self.derived[logical] = (axes.parent, axes.extra)
                self._check_dup(logical, axes.extra)
                continue
            if isinstance(axes, balanced):
                self.balanced_dims.add(logical)
                axes = axes.axes
            if not (axes is None or isinstance(axes, str) or (isinstance(axes, (tuple, list)) and all(
                    isinstance(a, str) for a in axes))):
                raise TypeError(f"Rules: the rule for dim {logical!r} must be a mesh axis name, a sequence of them, "
                                f"None, balanced(...) or inherit(...), got {axes!r} (e.g. Rules({logical}='tp'))")
            axes = as_axes(axes)
            self._check_dup(logical, axes)
            self.table[logical] = axes
        for logical in self.derived:
            seen, d = [logical], logical
            while d in self.derived:
                d = self.derived[d][0]
                if d in seen:
                    raise ValueError(f"Rules: derived names form a cycle {' -> '.join(seen + [d])}; "
                                     f"one of them needs a rule of its own")
                seen.append(d)
        self._resolved: dict = {}
        self._warned: set = set()
        self._seen: set[str] = set()        # dimension names resolved eagerly (check_used)
        self._library: frozenset[str] = frozenset()     # names written by library defaults

    def as_defaults(self) -> "Rules":
        """A copy whose every rule counts as a library default: :meth:`check_used` never
        questions its names (``llama.default_rules`` names dimensions of many models). A rule
        given later through :meth:`replace` is checked again."""
        out = Rules(self.entries())
        out._library = frozenset(out.entries())
        return out

    @staticmethod
    def _check_dup(logical: str, axes: AxisNames) -> None:
        dup = {a for a in axes if axes.count(a) > 1}
        if dup:
            raise ValueError(
                f"Rule for dim {logical!r} names mesh axis {sorted(dup)[0]!r} twice "
                f"({axes}); a mesh axis can split a dimension only once."
            )

    def parent(self, logical: str) -> str | None:
        """The name ``logical`` is derived from (inherit), or None."""
        if logical in self.table:
            return None
        if logical in self.derived:
            return self.derived[logical][0]
        return self.DEFAULT_DERIVED.get(logical, (None,))[0]

    def __getitem__(self, logical: str) -> AxisNames:
        if logical in self.table:
            return self.table[logical]
        rel = self.derived.get(logical) or self.DEFAULT_DERIVED.get(logical)
        if rel is None:
            return ()
        base = self[rel[0]]
        return base + tuple(a for a in rel[1] if a not in base)

    def is_balanced(self, logical: str) -> bool:
        """Whether the rule of ``logical`` (or of the name it inherits) asks for load-balanced
        order; whether a given split honours it is :meth:`splits_balanced`."""
        return self.balanced_axis(logical) is not None

    def balanced_axis(self, logical: str) -> str | None:
        """The mesh axis a ``balanced(...)`` rule balances ``logical`` over (the rule's first
        axis, inherited by derived names), or None for a contiguous rule."""
        while logical not in self.table:
            logical = self.parent(logical)
            if logical is None:
                return None
        axes = self.table[logical]
        return axes[0] if logical in self.balanced_dims and axes else None

    def splits_balanced(self, logical: str, split: Sequence[str]) -> bool:
        """Whether ``split`` (the mesh axes splitting ``logical``, major first) lays it out in
        load-balanced order: only when its first axis is the one the balanced rule names. A
        dimension split over other axes alone (the residual's tp under sequence parallelism
        with cp=1) is contiguous (docs/layouts.md)."""
        return bool(split) and split[0] == self.balanced_axis(logical)

    def entries(self) -> dict:
        """Every declared rule as given: mesh axes, ``balanced`` or ``inherit``."""
        out: dict = {k: (balanced(v) if k in self.balanced_dims else v) for k, v in self.table.items()}
        out.update({k: inherit(p, *e) for k, (p, e) in self.derived.items()})
        return out

    def replace(self, **rules) -> "Rules":
        """A copy with some rules changed (None removes a rule; a plain rule is contiguous)."""
        merged = self.entries()
        merged.update(rules)
        out = Rules({k: v for k, v in merged.items() if v is not None})
        out._library = self._library - set(rules)
        return out

    def check_mesh_axes(self, mesh: Mesh, where: str = "train_step") -> None:
        """Raise a ValueError for a mesh axis that looks misspelt: of size > 1, named by no rule,
        while a close name that the rules do name has size 1 (``Mesh(tpp=2)`` beside rules over
        ``tp``: every device along ``tpp`` would do the same work, nothing split)."""
        named = {a for axes in self.table.values() for a in axes} | {a for _, extra in self.derived.values()
                                                                     for a in extra}
        for a in mesh.axis_names:
            if mesh.shape[a] > 1 and a not in named:
                close = difflib.get_close_matches(a, sorted(named), n=1, cutoff=0.6)
                if close and mesh.shape.get(close[0], 1) == 1:
                    raise ValueError(
                        f"{where}: mesh axis {a!r} (size {mesh.shape[a]}) is named by no rule, while {close[0]!r}, "
                        f"which the rules split dimensions over, has size 1: did you mean "
                        f"Mesh({close[0]}={mesh.shape[a]})? (mesh {dict(mesh.shape)})")

    def check_used(self, used: Iterable[str], where: str = "train_step") -> None:
        """Raise a ValueError for a rule that looks like a misspelt dimension name: no
        parameter, batch entry or op of the step used its name, while a close name was used
        that has no rule of its own (``Rules(mpl="tp")`` beside a model's ``mlp``, left whole).
        A rule for a name far from every used one is fine (rules are model-agnostic:
        ``experts`` on a dense model), and so is every library default (:meth:`as_defaults`).
        ``used``: the names the step used; the names :meth:`resolve` saw eagerly count too."""
        used = set(used) | self._seen
        for name in list(used):              # a used derived name uses its parents' rules
            while (name := self.parent(name)) is not None and name not in used:
                used.add(name)
        ruled = set(self.table) | set(self.derived)
        unruled = sorted(u for u in used if u not in ruled)
        for name in sorted(ruled - used - self._library):
            close = difflib.get_close_matches(name, unruled, n=1, cutoff=0.6)
            if close:
                rule = self.entries()[name]
                raise ValueError(
                    f"{where}: the rule {name}={rule!r} names a dimension that no parameter, batch entry or op of "
                    f"this step has, and {close[0]!r}, which it has, has no rule (it stays whole): did you mean "
                    f"{close[0]}={rule!r}? Dimension names used: {sorted(used)}. If {name!r} is a dimension of "
                    f"another model, give {close[0]!r} a rule of its own ({close[0]}=None keeps it whole)")

    def check(self, mesh: Mesh) -> None:
        """Raise if a rule names a mesh axis that ``mesh`` does not have."""
        for logical, (_, extra) in self.derived.items():
            for a in extra:
                if a not in mesh.shape:
                    raise ValueError(f"Rule {logical}=inherit(..., {a!r}) names mesh axis {a!r}, but "
                                     f"the mesh has axes {mesh.axis_names}.")
        for logical, axes in self.table.items():
            for a in axes:
                if a not in mesh.shape:
                    hint = difflib.get_close_matches(a, mesh.axis_names, n=1)
                    raise ValueError(
                        f"Rule {logical}={axes!r} names mesh axis {a!r}, but the mesh has axes "
                        f"{mesh.axis_names}." + (f" Did you mean {hint[0]!r}?" if hint else "")
                    )

    def resolve(self, dims: Sequence[str], shape: Sequence[int] | None, mesh: Mesh,
                name: str = "tensor") -> Layout:
        """Layout of a tensor whose dimensions are named ``dims`` (docs/semantics.md): each dimension
        takes its rule's mesh axes except those an earlier dimension already took; axes of
        size 1 are dropped. Checks divisibility when ``shape`` (global) is given."""
        key = (tuple(dims), None if shape is None else tuple(shape), mesh)
        compiling = is_tracing()     # a cache would add guards to compiled code
        cached = None if compiling else self._resolved.get(key)
        if cached is not None:
            return cached
        if not compiling:
            self._seen.update(dims)  # (each key once: the cache holds it from here)
        self.check(mesh)
        taken: set[str] = set()
        layout = []
        for d in dims:
            axes = tuple(a for a in self[d] if a not in taken and mesh.shape[a] > 1)
            taken.update(axes)
            layout.append(axes)
        layout = tuple(layout)
        if shape is not None:
            check_divisible(shape, layout, mesh, name, dims)
            for d, axes in zip(dims, layout):
                if self.splits_balanced(d, axes):
                    n = shape[list(dims).index(d)]
                    if n % (2 * mesh.shape[axes[0]]):
                        raise ValueError(
                            f"{name}: dim {d!r} of size {n} is load-balanced over "
                            f"{axes[0]!r} ({mesh.shape[axes[0]]} devices, 2 chunks each) and needs "
                            f"a size divisible by {2 * mesh.shape[axes[0]]}; change the size or "
                            f"make the rule contiguous")
        if not compiling:
            self._warn_underived(dims, mesh)
            self._resolved[key] = layout    # rules are immutable: resolve each shape once
        return layout

    def _warn_underived(self, dims: Sequence[str], mesh: Mesh) -> None:
        """Warn once per name when a dimension without a rule looks derived from one that this
        mesh splits (``res_tok`` next to a split ``tok``): it stays whole, probably by mistake."""
        for d in dims:
            if d in self._warned or d in self.table or self.parent(d) is not None:
                continue
            for p in self.table:
                if p != d and (d.endswith("_" + p) or d.startswith(p + "_")) and \
                        any(mesh.shape.get(a, 1) > 1 for a in self.table[p]):
                    self._warned.add(d)
                    warnings.warn(
                        f"dim {d!r} has no rule and stays whole, while {p!r} is split over "
                        f"{self.table[p]}; if {d!r} is derived from {p!r}, declare "
                        f"Rules(..., {d}=inherit({p!r})), or give it a rule (None to silence)",
                        stacklevel=3)
                    break

    def __repr__(self) -> str:
        return "Rules(" + ", ".join(f"{k}={v!r}" for k, v in self.entries().items()) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rules) and self.entries() == other.entries()


def spec_to_layout(spec: Sequence, ndim: int, mesh: Mesh, name: str = "tensor",
                   shape: Sequence[int] | None = None, dims: Sequence[str] | None = None) -> Layout:
    """Validate an explicit partition spec and turn it into a layout."""
    entries = list(spec)
    if len(entries) > ndim:
        raise ValueError(f"{name}: spec {spec!r} has {len(entries)} entries but the tensor has "
                         f"{ndim} dimensions")
    entries += [None] * (ndim - len(entries))
    owner: dict[str, int] = {}
    layout = []
    for i, e in enumerate(entries):
        axes = as_axes(e)
        for a in axes:
            if a not in mesh.shape:
                hint = difflib.get_close_matches(a, mesh.axis_names, n=1)
                raise ValueError(f"{name}: spec {spec!r} names unknown mesh axis {a!r}; the mesh "
                                 f"has {mesh.axis_names}." + (f" Did you mean {hint[0]!r}?" if hint else ""))
            if a in owner:
                d0 = dims[owner[a]] if dims else f"dim {owner[a]}"
                d1 = dims[i] if dims else f"dim {i}"
                raise ValueError(f"{name}: dimensions {d0!r} and {d1!r} both want mesh axis {a!r} "
                                 f"in spec {spec!r}; a mesh axis can split only one dimension "
                                 f"of a tensor.")
            owner[a] = i
        layout.append(tuple(a for a in axes if mesh.shape[a] > 1))
    layout = tuple(layout)
    if shape is not None:
        check_divisible(shape, layout, mesh, name, dims)
    return layout


def check_divisible(shape: Sequence[int], layout: Layout, mesh: Mesh, name: str,
                    dims: Sequence[str] | None = None) -> None:
    for i, (n, axes) in enumerate(zip(shape, layout)):
        k = mesh.axis_size(axes) if axes else 1
        if n % k:
            label = f"dim {dims[i]!r}" if dims else f"dimension {i}"
            sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise ValueError(
                f"{name}: {label} has size {n}, which is not divisible by its mesh axes "
                f"{axes} ({sizes} = {k}); change the size or the rule for it."
            )


def local_shape(shape: Sequence[int], layout: Layout, mesh: Mesh) -> tuple[int, ...]:
    return tuple(n // (mesh.axis_size(axes) if axes else 1) for n, axes in zip(shape, layout))


def global_shape(shape: Sequence[int], layout: Layout, mesh: Mesh) -> tuple[int, ...]:
    return tuple(n * (mesh.axis_size(axes) if axes else 1) for n, axes in zip(shape, layout))


def layout_axes(layout: Iterable[AxisNames]) -> frozenset[str]:
    """All mesh axes used by a layout."""
    return frozenset(a for axes in layout for a in axes)


def require_contiguous(rules: Rules, dims: Sequence[str], layout: Layout, name: str) -> None:
    """Refuse a load-balanced split where only contiguous blocks are supported (parameters,
    checkpoints): name the dimension and the fix."""
    for d, axes in zip(dims, layout):
        if rules.splits_balanced(d, axes):
            raise ValueError(f"{name}: dimension {d!r} is split over {axes} in load-balanced order, "
                             f"which parameters do not support; give parameters their own "
                             f"dimension name (e.g. 'pos' for a position table) or a contiguous rule")


def block_slices(shape: Sequence[int], layout: Layout, mesh: Mesh, rank: int) -> tuple[slice, ...]:
    """The slice of the global tensor that ``rank`` holds under a contiguous ``layout``."""
    out = []
    for n, axes in zip(shape, layout):
        if not axes:
            out.append(slice(0, n))
            continue
        k = mesh.axis_size(axes)
        i = mesh.axis_index(rank, axes)
        out.append(slice(i * n // k, (i + 1) * n // k))
    return tuple(out)
