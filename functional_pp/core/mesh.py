"""Device mesh: named axes with sizes, rank <-> coordinate maps and axis groups."""
from __future__ import annotations

import difflib
import itertools
from typing import Iterable, Mapping, Sequence

from functional_pp._torch import is_tracing

DEFAULT_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
AxisNames = tuple[str, ...]


def _compiling() -> bool:
    return is_tracing()


def as_axes(axes: str | Iterable[str] | None) -> AxisNames:
    """Normalise one axis name, a sequence of names or None to a tuple."""
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def unknown_axis_error(name: str, known: Sequence[str], where: str) -> ValueError:
    hint = difflib.get_close_matches(name, known, n=1)
    suggestion = f" Did you mean {hint[0]!r}?" if hint else ""
    return ValueError(
        f"{where}: unknown mesh axis {name!r}; the mesh has axes {tuple(known)}.{suggestion}"
    )


class Mesh:
    """A logical device mesh with named axes, laid out row-major (last axis fastest).

    ``Mesh(dp_replicate=2, dp_shard=2, cp=2, tp=2)`` uses Accelerate's names and order:
    ``dp_replicate`` outermost, ``tp`` innermost so tensor-parallel ranks are neighbours.
    Extra axes (``Mesh(tp=2, ep=4)``) follow the default ones in keyword order, except ``pp``
    (pipeline stages), which comes first as in torchtitan's ``pp x dp x cp x tp``; use
    :meth:`from_axes` to choose the order of every axis.
    """

    def __init__(self, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1,
                 **more_axes: int):
        sizes = {"pp": more_axes.pop("pp")} if "pp" in more_axes else {}    # pipeline stages: outermost
        sizes.update(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp)
        sizes.update(more_axes)
        self._init(list(sizes.items()))

    @classmethod
    def from_axes(cls, axes: Sequence[tuple[str, int]] | Mapping[str, int]) -> "Mesh":
        """A mesh with exactly these axes, in this order (outermost first)."""
        mesh = cls.__new__(cls)
        mesh._init(list(axes.items()) if isinstance(axes, Mapping) else list(axes))
        return mesh

    def _init(self, items: list[tuple[str, int]]) -> None:
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            raise ValueError(f"Mesh axis names must be unique, got {names}")
        for name, size in items:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(
                    f"Mesh axis {name!r} has size {size!r}; every axis size must be an integer >= 1 "
                    f"(use 1 to switch that kind of parallelism off)."
                )
        self.axis_names: AxisNames = tuple(names)
        self.shape: dict[str, int] = dict(items)
        self._memo: dict = {}     # (what, rank, axes) -> group / index: collectives ask every call
        self._strides: dict[str, int] = {}   # row-major (computed here, not lazily: traced code reads it)
        stride = 1
        for a in reversed(self.axis_names):
            self._strides[a] = stride
            stride *= self.shape[a]

    # ----------------------------------------------------------------- sizes
    @property
    def size(self) -> int:
        """Number of devices in the mesh."""
        n = 1
        for s in self.shape.values():
            n *= s
        return n

    def axis_size(self, axes: str | Iterable[str]) -> int:
        """Product of the sizes of the given axes."""
        n = 1
        for a in self.check_axes(axes, "Mesh.axis_size"):
            n *= self.shape[a]
        return n

    def check_axes(self, axes: str | Iterable[str] | None, where: str) -> AxisNames:
        """Validate axis names (known, not repeated) and return them as a tuple."""
        axes = as_axes(axes)
        for a in axes:
            if a not in self.shape:
                raise unknown_axis_error(a, self.axis_names, where)
        if len(set(axes)) != len(axes):
            raise ValueError(f"{where}: mesh axes {axes} name one axis twice")
        return axes

    def validate_world_size(self, world_size: int) -> None:
        """Raise if the mesh does not have exactly ``world_size`` devices."""
        if self.size != world_size:
            dims = " x ".join(f"{a}={s}" for a, s in self.shape.items())
            raise ValueError(
                f"The mesh has {self.size} devices ({dims}) but the world size is {world_size}; "
                f"choose axis sizes whose product is {world_size}."
            )

    # ----------------------------------------------------------- coordinates
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` along every axis."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} devices")
        return {a: (rank // self._strides[a]) % self.shape[a] for a in self.axis_names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Rank of the device at ``coords`` (missing axes count as 0)."""
        for a in coords:
            if a not in self.shape:
                raise unknown_axis_error(a, self.axis_names, "Mesh.rank_of")
        return sum(coords.get(a, 0) * self._strides[a] for a in self.axis_names)

    def axis_index(self, rank: int, axes: str | Iterable[str]) -> int:
        """Index of ``rank`` inside its group along ``axes`` (first axis major)."""
        return self._memoised("index", rank, axes, self._axis_index)

    def group(self, rank: int, axes: str | Iterable[str]) -> tuple[int, ...]:
        """Ranks of the group of ``rank`` along ``axes``, ordered by group index."""
        return self._memoised("group", rank, axes, self._group)

    def _memoised(self, what: str, rank: int, axes, compute):
        """``compute(rank, axes)`` once per (rank, axes) of this mesh; not while torch.compile
        traces (a lookup in the memo would become guards on its contents)."""
        axes = as_axes(axes)
        key = (what, rank, axes)
        compiling = _compiling()          # (asked once: collectives call this every time)
        if not compiling:
            found = self._memo.get(key)
            if found is not None:
                return found
        value = compute(rank, axes)
        if not compiling:
            self._memo[key] = value
        return value

    def _axis_index(self, rank: int, axes: AxisNames) -> int:
        c = self.coords(rank)
        idx = 0
        for a in self.check_axes(axes, "Mesh.axis_index"):
            idx = idx * self.shape[a] + c[a]
        return idx

    def _group(self, rank: int, axes: AxisNames) -> tuple[int, ...]:
        axes = self.check_axes(axes, "Mesh.group")
        base = self.coords(rank)
        ranks = []
        for idx in itertools.product(*(range(self.shape[a]) for a in axes)):
            c = dict(base)
            c.update(zip(axes, idx))
            ranks.append(self.rank_of(c))
        return tuple(ranks)

    def groups(self, axes: str | Iterable[str]) -> list[tuple[int, ...]]:
        """Every group along ``axes`` (a partition of all ranks), in order of first rank."""
        seen, out = set(), []
        for r in range(self.size):
            g = self.group(r, axes)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return out

    def describe(self) -> str:
        return " x ".join(f"{a}={s}" for a, s in self.shape.items()) + f" ({self.size} devices)"

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{a}={s}" for a, s in self.shape.items()) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and list(self.shape.items()) == list(other.shape.items())

    def __hash__(self) -> int:
        return hash(tuple(self.shape.items()))


def require_mesh(mesh: object, where: str) -> None:
    """Raise a TypeError naming ``where`` when ``mesh`` is not a :class:`Mesh` (an int of devices,
    a dict of axis sizes), with the Mesh to write instead."""
    if not isinstance(mesh, Mesh):
        n = mesh if isinstance(mesh, int) and not isinstance(mesh, bool) else 2
        raise TypeError(f"{where}: mesh must be a functional_pp.Mesh, got {type(mesh).__name__} {mesh!r} "
                        f"(e.g. fpp.Mesh(dp_shard={n}))")
