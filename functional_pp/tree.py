"""Parameter pytrees: declarations with logical axes, path utilities, sharding and gathering.

Containers are plain dicts/lists/tuples, which both optree and torch's pytree utilities
(and so torch.compile) understand."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import optree
import torch

from .layout import Rules, block_slices, require_contiguous
from .mesh import Mesh


@dataclass(frozen=True)
class Param:
    """Declaration of one parameter: global shape, logical axes and initializer."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"          # normal | zeros | ones | uniform
    scale: float = 0.02           # std for normal, half-width for uniform
    dtype: torch.dtype = torch.float32
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"param of shape {self.shape} needs one logical axis per dimension, "
                             f"got axes {self.axes}")


def param(shape: Sequence[int], axes: Sequence[str] | str, init: str = "normal", scale: float = 0.02,
          dtype: torch.dtype = torch.float32) -> Param:
    """Declare a parameter: ``param((hidden, mlp), axes=("hidden", "mlp"), init="normal", scale=0.02)``.
    ``axes`` may also be a space-separated string ``"hidden mlp"``."""
    if isinstance(axes, str):
        axes = tuple(axes.split())
    if init not in ("normal", "zeros", "ones", "uniform"):
        raise ValueError(f"unknown init {init!r}; use normal, zeros, ones or uniform")
    return Param(tuple(int(s) for s in shape), tuple(axes), init, float(scale), dtype)


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
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False)


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


def shard(full: Any, decls: Any, mesh: Mesh, rules: Rules, rank: int) -> Any:
    """Cut a full tree into the shards of ``rank`` (views, no copies)."""
    def cut(p, x, d):
        if tuple(x.shape) != d.shape:
            raise ValueError(f"{p}: tensor has shape {tuple(x.shape)} but is declared {d.shape}")
        layout = rules.resolve(d.axes, d.shape, mesh, name=p)
        require_contiguous(rules, d.axes, layout, p)
        return x[block_slices(d.shape, layout, mesh, rank)]
    return map_with_path(cut, full, decls)


def gather(local: Any, decls: Any, rules: Rules) -> Any:
    """Inside a launched function: gather every device's shards back into full tensors."""
    from .collectives import raw_all_gather
    from .runtime import current_mesh

    mesh = current_mesh()

    def full(p, x, d):
        layout = rules.resolve(d.axes, d.shape, mesh, name=p)
        for dim, axes in enumerate(layout):
            if axes:
                x = raw_all_gather(x.detach(), axes, dim)
        return x
    return map_with_path(full, local, decls)




def named_tree(local: Any, decls: Any) -> Any:
    """Wrap this device's shards as named arrays laid out by the active rules."""
    from .named import Named, env

    mesh, rules = env()

    def wrap(p, x, d):
        n = Named(x, d.axes, rules.resolve(d.axes, d.shape, mesh, name=p))
        n.is_param = True
        return n
    return map_with_path(wrap, local, decls)
