"""Mesh-independent parameter initialisation that builds only this device's shards.

Values come from a counter-based hash of (seed, parameter path, global element index), so a
shard equals the matching slice of the single-device init, whatever the mesh, and the full
tensor is never materialised."""
from __future__ import annotations

import math
import zlib
from typing import Any, Callable

import torch

from .layout import Rules, block_slices, require_contiguous
from .mesh import Mesh
from .seeds import check_seed
from .tree import Param, map_with_path

_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding 32-bit values (no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _global_index(shape: tuple[int, ...], slices: tuple[slice, ...]) -> torch.Tensor:
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for n, sl in reversed(list(zip(shape, slices))):
        r = torch.arange(sl.start, sl.stop, dtype=torch.int64) * stride
        idx = r.reshape(-1, *([1] * idx.ndim)) + idx
        stride *= n
    return idx


def _uniform(idx: torch.Tensor, key: int, stream: int) -> torch.Tensor:
    k = _hash32(torch.tensor((key * 0x9E3779B1 + stream * 0x85EBCA77) & _M32))
    h = _hash32(_hash32((idx & _M32) ^ k) ^ ((idx >> 32) & _M32))
    return ((h >> 8).double() + 0.5) / float(1 << 24)


def init_block(decl: Param, path: str, seed: int, slices: tuple[slice, ...],
               device: torch.device | str | None = None) -> torch.Tensor:
    """The block ``slices`` of parameter ``path`` initialised with ``seed``."""
    shape = tuple(sl.stop - sl.start for sl in slices)
    if decl.init == "zeros":
        return torch.zeros(shape, dtype=decl.dtype, device=device)
    if decl.init == "ones":
        return torch.ones(shape, dtype=decl.dtype, device=device)
    key = (zlib.crc32(path.encode()) ^ (seed * 0x27D4EB2F)) & _M32
    idx = _global_index(decl.shape, slices)
    u1 = _uniform(idx, key, 1)
    if decl.init == "uniform":
        out = (2 * u1 - 1) * decl.scale
    else:
        u2 = _uniform(idx, key, 2)
        out = torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2) * decl.scale
    return out.to(dtype=decl.dtype, device=device).reshape(shape)


def init_params(decls: Any, *, seed: int = 0, mesh: Mesh | None = None, rules: Rules | None = None,
                rank: int | None = None, device=None) -> Any:
    """Materialise a tree of :class:`Param` declarations: the full tree without a mesh, or
    the shards of ``rank`` (default: the running device) under ``mesh`` and ``rules``."""
    seed = check_seed(seed, "init: seed")
    if mesh is not None and rank is None:
        from .runtime import current_rank
        rank = current_rank()

    def make(p, d):
        if mesh is None:
            slices = tuple(slice(0, n) for n in d.shape)
        else:
            layout = (rules or Rules()).resolve(d.axes, d.shape, mesh, name=p)
            require_contiguous(rules or Rules(), d.axes, layout, p)
            slices = block_slices(d.shape, layout, mesh, rank)
        return init_block(d, p, seed, slices, device)
    return map_with_path(make, decls)


def init(init_fn: Callable[..., Any], *args, seed: int = 0, mesh: Mesh | None = None,
         rules: Rules | None = None, device=None, **kwargs) -> Any:
    """``init(llama.init, cfg, mesh=mesh, rules=rules, seed=0)``: call ``init_fn`` for the
    declarations and build this device's shards as named arrays (the full tree when ``mesh``
    is None); ``functional_pp.init_params`` gives plain tensors."""
    from .named import Named

    decls = init_fn(*args, **kwargs)
    tensors = init_params(decls, seed=seed, mesh=mesh, rules=rules, device=device)
    rules = rules or Rules()

    def wrap(p, x, d):
        return Named(x, d.axes, rules.resolve(d.axes, d.shape, mesh, name=p) if mesh is not None else None,
                     sizes=d.shape, is_param=True)
    return map_with_path(wrap, tensors, decls)
