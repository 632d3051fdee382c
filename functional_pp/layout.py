"""Layouts: which mesh axes split each dimension of a tensor, from rules or explicit specs."""
from __future__ import annotations

import difflib
from typing import Iterable, Mapping, Sequence

import torch

from .mesh import AxisNames, Mesh, as_axes

Layout = tuple[AxisNames, ...]  # per dimension, the mesh axes splitting it (major first)


class P(tuple):
    """A partition spec in mesh-axis terms: one entry per dimension, each None, an axis
    name or a tuple of axis names (like ``jax.sharding.PartitionSpec``)."""

    def __new__(cls, *entries):
        return super().__new__(cls, entries)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"


class Rules:
    """Map logical axis names to ordered tuples of mesh axes.

    ``Rules(batch=("dp_replicate", "dp_shard"), seq="cp", heads="tp", hidden="dp_shard")``.
    A logical axis without a rule is never split.
    """

    def __init__(self, mapping: Mapping[str, str | Sequence[str] | None] | None = None, **rules):
        merged = dict(mapping or {})
        merged.update(rules)
        self.table: dict[str, AxisNames] = {}
        for logical, axes in merged.items():
            axes = as_axes(axes)
            dup = {a for a in axes if axes.count(a) > 1}
            if dup:
                raise ValueError(
                    f"Rule for logical axis {logical!r} names mesh axis {sorted(dup)[0]!r} twice "
                    f"({axes}); a mesh axis can split a dimension only once."
                )
            self.table[logical] = axes
        self._resolved: dict = {}

    # Logical axes that follow another one unless given a rule of their own: the residual
    # stream's sequence ("res_seq") is laid out like "seq" unless sequence parallelism splits it.
    INHERIT = {"res_seq": "seq"}

    def __getitem__(self, logical: str) -> AxisNames:
        if logical not in self.table and logical in self.INHERIT:
            return self[self.INHERIT[logical]]
        return self.table.get(logical, ())

    def replace(self, **rules) -> "Rules":
        """A copy with some rules changed (None removes a rule)."""
        merged = dict(self.table)
        merged.update(rules)
        return Rules({k: v for k, v in merged.items() if v is not None})

    def check(self, mesh: Mesh) -> None:
        """Raise if a rule names a mesh axis that ``mesh`` does not have."""
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
        compiling = torch.compiler.is_compiling()     # a cache would add guards to compiled code
        cached = None if compiling else self._resolved.get(key)
        if cached is not None:
            return cached
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
        if not compiling:
            self._resolved[key] = layout    # rules are immutable: resolve each shape once
        return layout

    def __repr__(self) -> str:
        return "Rules(" + ", ".join(f"{k}={v!r}" for k, v in self.table.items()) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rules) and self.table == other.table


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
            label = f"logical axis {dims[i]!r}" if dims else f"dimension {i}"
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


def block_slices(shape: Sequence[int], layout: Layout, mesh: Mesh, rank: int) -> tuple[slice, ...]:
    """The slice of the global tensor that ``rank`` holds under ``layout``."""
    out = []
    for n, axes in zip(shape, layout):
        if not axes:
            out.append(slice(0, n))
            continue
        k = mesh.axis_size(axes)
        i = mesh.axis_index(rank, axes)
        out.append(slice(i * n // k, (i + 1) * n // k))
    return tuple(out)
