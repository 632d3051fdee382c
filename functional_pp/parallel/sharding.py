"""Parameter trees across devices: cut a full tree into one device's shards and wrap shards as
named values laid out by the rules (the way back is :func:`functional_pp.parallel.grads.gather_tree`)."""
from __future__ import annotations

from typing import Any

from functional_pp.core.layout import Rules, block_slices, require_contiguous
from functional_pp.core.mesh import Mesh
from functional_pp.core.tree import map_with_path
from functional_pp.parallel.named import Named, env

__all__ = ["shard", "named_tree"]


def shard(full: Any, decls: Any, mesh: Mesh, rules: Rules, rank: int) -> Any:
    """Cut a full tree into the shards of ``rank`` (views, no copies)."""
    def cut(p, x, d):
        if tuple(x.shape) != d.shape:
            raise ValueError(f"{p}: tensor has shape {tuple(x.shape)} but is declared {d.shape}")
        layout = rules.resolve(d.dims, d.shape, mesh, name=p)
        require_contiguous(rules, d.dims, layout, p)
        return x[block_slices(d.shape, layout, mesh, rank)]
    return map_with_path(cut, full, decls)


def named_tree(local: Any, decls: Any) -> Any:
    """Wrap this device's shards as named arrays laid out by the active rules."""
    mesh, rules = env()

    def wrap(p, x, d):
        return Named(x, d.dims, rules.resolve(d.dims, d.shape, mesh, name=p), sizes=d.shape, is_param=True)
    return map_with_path(wrap, local, decls)
