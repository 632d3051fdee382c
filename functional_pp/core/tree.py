"""Parameter pytrees: declarations (global shape and dimension names) and path utilities.

Cutting a tree into shards, gathering it back and wrapping shards as named values live in
:mod:`functional_pp.parallel.sharding` (``shard``, ``gather``, ``named_tree``).

Containers are plain dicts/lists/tuples, which both optree and torch's pytree utilities
(and so torch.compile) understand."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import optree
import torch

from functional_pp._torch import is_tracing


@dataclass(frozen=True)
class Param:
    """Declaration of one parameter: global shape, the names of its dimensions (``dims``;
    docs/names.md) and initializer."""

    shape: tuple[int, ...]
    dims: tuple[str, ...]
    init: str = "normal"          # normal | zeros | ones | uniform
    scale: float = 0.02           # std for normal, half-width for uniform
    dtype: torch.dtype = torch.float32
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if len(self.shape) != len(self.dims):
            raise ValueError(f"param of shape {self.shape} needs one name per dimension, "
                             f"got dimension names {self.dims}")
        twice = sorted({d for d in self.dims if self.dims.count(d) > 1})
        if twice:
            raise ValueError(f"param of shape {self.shape}: dimension name {twice[0]!r} is given twice ({self.dims}); "
                             f"each dimension needs a name of its own (e.g. 'hidden hidden_out')")
        bad = [n for n in self.shape if not isinstance(n, (int, float)) or isinstance(n, bool) or n < 0]
        if bad:
            raise ValueError(f"param of shape {self.shape} with dimensions {self.dims}: every size must be a "
                             f"number >= 0, got {bad[0]!r}")

    @property
    def axes(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`dims` (*axis* means a mesh axis; docs/names.md)."""
        warnings.warn("Param.axes is deprecated: use Param.dims (dimension names; docs/names.md)",
                      DeprecationWarning, stacklevel=2)
        return self.dims


def param(shape: Sequence[int], dims: Sequence[str] | str | None = None, init: str = "normal",
          scale: float = 0.02, dtype: torch.dtype = torch.float32, *, axes: Sequence[str] | str | None = None
          ) -> Param:
    """Declare a parameter: ``param((hidden, mlp), dims=("hidden", "mlp"), init="normal", scale=0.02)``.
    ``dims`` may also be a space-separated string ``"hidden mlp"`` (``axes=`` is its deprecated
    name)."""
    if axes is not None:
        if dims is not None:
            raise TypeError("param: pass the dimension names once, as dims= (axes= is its deprecated name)")
        warnings.warn("param(axes=...) is deprecated: use param(dims=...) (docs/names.md)", DeprecationWarning,
                      stacklevel=2)
        dims = axes
    if dims is None:
        raise TypeError("param: missing the dimension names, e.g. param((512, 1024), dims='hidden mlp')")
    if isinstance(dims, str):
        dims = tuple(dims.split())
    if init not in ("normal", "zeros", "ones", "uniform", "constant"):
        raise ValueError(f"unknown init {init!r}; use normal, zeros, ones, uniform or constant (every entry ``scale``)")
    return Param(tuple(_size(s, shape, dims) for s in shape), tuple(dims), init, float(scale), dtype)


def _size(n: Any, shape: Sequence[Any], dims: Sequence[str]) -> Any:
    """A declared size as an int; a fractional one (``hidden / 3``) is refused, not truncated.
    Other values pass through for :class:`Param` to refuse by name."""
    if isinstance(n, float) and not n.is_integer():
        raise ValueError(f"param of shape {tuple(shape)} with dimensions {tuple(dims)}: every size must be a whole "
                         f"number, got {n!r} (int(...) would have truncated it; e.g. hidden // 3)")
    try:
        return int(n) if not isinstance(n, bool) else n
    except (TypeError, ValueError):
        return n


def path_str(path: Sequence[Any]) -> str:
    """``("layers", 0, "attn", "wq")`` -> ``"layers.0.attn.wq"``."""
    return ".".join(str(p) for p in path)


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    """``[(path, leaf), ...]`` in tree order."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    return [(path_str(p), leaf) for p, leaf in zip(paths, leaves)]


def map_with_path(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn(path_string, leaf, *other_leaves)`` over every leaf."""
    return optree.tree_map_with_path(lambda p, *xs: fn(path_str(p), *xs), tree, *rest,
                                     none_is_leaf=False)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` with ``None`` as an empty subtree (the package's convention)."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False)


def tree_leaves(tree: Any) -> list:
    """The leaves of ``tree`` (``None`` is an empty subtree)."""
    if is_tracing():
        leaves: list = []
        if _plain_leaves(tree, leaves):
            return leaves
    return optree.tree_leaves(tree, none_is_leaf=False)


_OPTREE_ITER = getattr(optree, "tree_iter", None)     # (optree 0.14 on)


def tree_iter(tree: Any) -> Iterator[Any]:
    """The leaves of ``tree`` one at a time, in :func:`tree_leaves`' order. Eager, lazily
    (``optree.tree_iter``): a look at the first leaf (``step.buffers.device_of``, twice a
    step) flattens nothing else, where a whole flatten of a model's parameters costs tens of
    microseconds; traced, or on an optree without it, :func:`tree_leaves`."""
    if _OPTREE_ITER is None or is_tracing():
        return iter(tree_leaves(tree))
    return _OPTREE_ITER(tree, none_is_leaf=False)


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """``(leaves, treespec)`` of ``tree`` (``None`` is an empty subtree); the spec is for
    :func:`tree_unflatten`."""
    if is_tracing():
        leaves: list = []
        if _plain_leaves(tree, leaves):
            return leaves, PlainSpec(tree)
    return optree.tree_flatten(tree, none_is_leaf=False)


def tree_unflatten(spec: Any, leaves: Sequence[Any]) -> Any:
    """The tree of ``spec`` (from :func:`tree_flatten`) with these leaves."""
    if isinstance(spec, PlainSpec):
        return spec.unflatten(leaves)
    return optree.tree_unflatten(spec, leaves)


# Traced by torch.compile, optree's flatten runs as dynamo's Python model of optree, which made up
# about a third of the time dynamo spent tracing a training step (docs/compile.md "Tracing
# time"). Trees of plain dicts, lists and tuples with tensor leaves, what parameters, gradients
# and optimizer states are, are flattened here in the same order (dict keys sorted, as optree
# sorts them) by a few lines dynamo traces quickly; anything else goes to optree.
_PLAIN_LEAVES = (torch.Tensor,)


def _plain_leaves(tree: Any, out: list) -> bool:
    """Append ``tree``'s leaves to ``out`` if it is a plain tree (dicts with str keys, lists,
    tuples, None, tensor leaves); False (``out`` then unusable) otherwise."""
    kind = type(tree)
    if kind is dict:
        keys = list(tree)
        if not all(type(k) is str for k in keys):
            return False
        return all(_plain_leaves(tree[k], out) for k in sorted(keys))
    if kind is list or kind is tuple:
        return all(_plain_leaves(x, out) for x in tree)
    if tree is None:
        return True
    if isinstance(tree, _PLAIN_LEAVES):
        out.append(tree)
        return True
    return False


class PlainSpec:
    """The structure of a plain tree (see :func:`_plain_leaves`), for :func:`tree_unflatten`."""

    def __init__(self, tree: Any):
        self._tree = _skeleton(tree)      # no reference to the leaves: they may be freed

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        it = iter(leaves)
        out = _rebuild(self._tree, it)
        if next(it, _END) is not _END:
            raise ValueError("tree_unflatten: more leaves than the tree has")
        return out


_END = object()
_LEAF = object()


def _skeleton(tree: Any) -> Any:
    kind = type(tree)
    if kind is dict:
        return {k: _skeleton(v) for k, v in tree.items()}
    if kind is list:
        return [_skeleton(x) for x in tree]
    if kind is tuple:
        return tuple(_skeleton(x) for x in tree)
    return None if tree is None else _LEAF


def _rebuild(tree: Any, it) -> Any:
    kind = type(tree)
    if kind is dict:
        new = {k: _rebuild(tree[k], it) for k in sorted(tree)}
        return {k: new[k] for k in tree}          # the original insertion order, as optree keeps it
    if kind is list:
        return [_rebuild(x, it) for x in tree]
    if kind is tuple:
        return tuple(_rebuild(x, it) for x in tree)
    if tree is None:
        return None
    leaf = next(it, _END)
    if leaf is _END:
        raise ValueError("tree_unflatten: fewer leaves than the tree has")
    return leaf


def count_params(tree: Any) -> int:
    """Number of scalars in a tree of tensors or :class:`Param` declarations."""
    total = 0
    for leaf in optree.tree_leaves(tree, none_is_leaf=False):
        if isinstance(leaf, Param):
            n = 1
            for s in leaf.shape:
                n *= s
            total += n
        elif isinstance(leaf, torch.Tensor):
            total += leaf.numel()
    return total
