"""Mesh-independent parameter initialisation that builds only this device's shards.

Each parameter is cut, in row-major order of its *global* shape, into tiles of ``TILE``
elements; every tile is drawn from its own pair of generator streams seeded by a hash of
(seed, parameter path, tile index). A device generates the tiles its shard overlaps and takes
its elements, so a shard equals the matching slice of the single-device init whatever the
mesh, and the full tensor is never materialised (docs/init.md).
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Callable

import torch

from .layout import Rules, block_slices, require_contiguous
from .mesh import Mesh
from .seeds import check_seed
from .tree import Param, map_with_path

TILE = 1 << 16          # elements per tile: per-tile seeding costs ~1% of generating it
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _param_key(seed: int, path: str) -> int:
    return _mix64(_mix64(seed) ^ zlib.crc32(path.encode()))


def _fill_tiles(buf: torch.Tensor, first_tile: int, numel: int, key: int, decl: Param) -> None:
    """Fill ``buf`` (global flat elements from ``first_tile * TILE``) tile by tile. Each tile
    is the sum of two draws from torch's CPU generator (mt19937 takes 32-bit seeds: two
    independent streams make two tiles equal only if 64 bits of their hashes collide):
    normal: ``(a + b) / sqrt(2)`` of two standard normals; uniform: ``(a + b) mod 1`` of two
    U[0, 1) (uniform again), mapped to [-1, 1); then times the declared scale, while the tile
    is in cache."""
    gen, tmp = torch.Generator(), None
    uniform = decl.init == "uniform"
    for i, start in enumerate(range(0, buf.numel(), TILE)):
        tile = first_tile + i
        size = min(TILE, numel - tile * TILE)          # the last tile of a tensor is shorter
        out = buf[start:start + size]
        h = _mix64(key ^ _mix64(tile))
        if tmp is None or tmp.numel() != size:
            tmp = torch.empty(size, dtype=buf.dtype)
        for target, seed in ((out, h & 0xFFFFFFFF), (tmp, h >> 32)):
            gen.manual_seed(seed)
            if uniform:
                target.uniform_(0.0, 1.0, generator=gen)
            else:
                target.normal_(generator=gen)
        out.add_(tmp)
        if uniform:
            out.frac_().mul_(2.0).sub_(1.0).mul_(decl.scale)
        else:
            out.mul_(decl.scale / math.sqrt(2.0))      # a + b has variance 2


def init_block(decl: Param, path: str, seed: int, slices: tuple[slice, ...],
               device: torch.device | str | None = None) -> torch.Tensor:
    """The block ``slices`` of parameter ``path`` initialised with ``seed`` (the same values
    as the same elements of the whole parameter's init)."""
    shape = tuple(sl.stop - sl.start for sl in slices)
    if decl.init == "zeros":
        return torch.zeros(shape, dtype=decl.dtype, device=device)
    if decl.init == "ones":
        return torch.ones(shape, dtype=decl.dtype, device=device)
    if any(n == 0 for n in shape):
        return torch.empty(shape, dtype=decl.dtype, device=device)
    strides = [1] * len(decl.shape)
    for d in range(len(decl.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * decl.shape[d + 1]
    first = sum(sl.start * st for sl, st in zip(slices, strides))          # flat index range
    last = sum((sl.stop - 1) * st for sl, st in zip(slices, strides))      # of the block
    t0, t1 = first // TILE, last // TILE
    numel = math.prod(decl.shape)
    start = t0 * TILE
    buf = torch.empty(min((t1 + 1) * TILE, numel) - start, dtype=torch.float32)
    _fill_tiles(buf, t0, numel, _param_key(seed, path), decl)
    if first == start and last - first + 1 == buf.numel() == math.prod(shape):
        block = buf.view(shape)                          # the block is the generated range
    else:
        block = buf.as_strided(shape, strides, first - start).clone(memory_format=torch.contiguous_format)
    return block.to(dtype=decl.dtype, device=device)


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
            layout = (rules or Rules()).resolve(d.dims, d.shape, mesh, name=p)
            require_contiguous(rules or Rules(), d.dims, layout, p)
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
        return Named(x, d.dims, rules.resolve(d.dims, d.shape, mesh, name=p) if mesh is not None else None,
                     sizes=d.shape, is_param=True)
    return map_with_path(wrap, tensors, decls)
