"""Mesh-independent parameter initialisation that builds only this device's shards.

Each parameter's *global* shape is cut into a grid of blocks ("tiles", at most ``TILE``
elements, about an eighth of each dim); every tile is drawn from its own pair of generator
streams seeded by a hash of (seed, parameter path, tile index). A device generates the tiles
its shard overlaps and takes its elements, so a shard equals the matching slice of the
single-device init whatever the mesh, the full tensor is never materialised, and a shard that
splits a dim up to 8 ways generates only what it keeps (docs/init.md).
"""
from __future__ import annotations

import itertools
import math
import zlib
from typing import Any, Callable

import numpy as np
import torch

from functional_pp._torch import check_mt19937_state_layout, mt19937_state
from functional_pp.core.layout import Rules, block_slices, require_contiguous
from functional_pp.core.mesh import Mesh
from functional_pp.core.seeds import check_seed
from functional_pp.core.tree import Param, map_with_path

TILE = 1 << 16          # at most this many elements per tile: per-tile seeding is then ~1%
TILE_SPLITS = 8         # a dim is cut into at least this many tiles where it can be,
INNER_TILE = 256        # and an inner dim into pieces of at most this many elements
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _param_key(seed: int, path: str) -> int:
    return _mix64(_mix64(seed) ^ zlib.crc32(path.encode()))


def tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The extent of a tile along each dim of a parameter of global ``shape``: about an eighth
    of the dim (so a shard that splits any dim up to 8 ways starts and ends on tile borders
    and generates only what it keeps), inner dims at most ``INNER_TILE``, and at most ``TILE``
    elements in all; a parameter of at most ``TILE`` elements is one tile (docs/init.md)."""
    if math.prod(shape) <= TILE:
        return tuple(shape)
    budget, out = TILE, []
    for i in range(len(shape) - 1, -1, -1):
        n = shape[i]
        t = min(max(n // TILE_SPLITS, 1), budget)
        if i > 0:
            t = min(t, INNER_TILE)
        out.append(t)
        budget = max(budget // t, 1)
    return tuple(reversed(out))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_WORD_STEPS = np.arange(1, 625, dtype=np.uint64) * _GOLDEN


def _tile_words(h: int) -> np.ndarray:
    """624 words from the splitmix64 stream of the 64-bit tile hash ``h``: a full mt19937
    state, so two tiles draw the same values only if their 64-bit hashes are equal."""
    x = np.uint64(h) + _WORD_STEPS
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _fill_tile(out: torch.Tensor, gen: torch.Generator, h: int, decl: Param) -> None:
    """Fill the flat ``out`` with tile values from the 64-bit hash ``h``: torch's CPU
    generator (mt19937) is given a whole state derived from ``h`` (``manual_seed`` keeps only
    32 bits) and draws each element once, already scaled: ``normal_(0, scale)`` or
    ``uniform_(-scale, scale)`` (docs/init.md)."""
    gen.set_state(mt19937_state(_tile_words(h), h))
    if decl.init == "uniform":
        out.uniform_(-decl.scale, decl.scale, generator=gen)
    else:
        out.normal_(0.0, decl.scale, generator=gen)


def init_block(decl: Param, path: str, seed: int, slices: tuple[slice, ...],
               device: torch.device | str | None = None) -> torch.Tensor:
    """The block ``slices`` of parameter ``path`` initialised with ``seed`` (the same values
    as the same elements of the whole parameter's init): the tiles of the global tensor's
    tile grid that the block overlaps are generated whole, each from its own seeds, and the
    block copies its part of each (docs/init.md)."""
    shape = tuple(sl.stop - sl.start for sl in slices)
    if decl.init == "zeros":
        return torch.zeros(shape, dtype=decl.dtype, device=device)
    if decl.init == "ones":
        return torch.ones(shape, dtype=decl.dtype, device=device)
    if decl.init == "constant":
        return torch.full(shape, decl.scale, dtype=decl.dtype, device=device)
    if any(n == 0 for n in shape):
        return torch.empty(shape, dtype=decl.dtype, device=device)
    check_mt19937_state_layout()
    tiles = tile_shape(tuple(decl.shape))
    grid = [-(-n // t) for n, t in zip(decl.shape, tiles)]
    key = _param_key(seed, path)
    block = torch.empty(shape, dtype=torch.float32)
    size = math.prod(tiles)
    buf, gen = torch.empty(size), torch.Generator()
    ranges = [range(sl.start // t, (sl.stop - 1) // t + 1) for sl, t in zip(slices, tiles)]
    for index in itertools.product(*ranges):
        flat = 0
        for i, g in zip(index, grid):
            flat = flat * g + i
        lo = [i * t for i, t in zip(index, tiles)]
        extent = [min(t, n - a) for t, n, a in zip(tiles, decl.shape, lo)]   # edge tiles are short
        count = math.prod(extent)
        tile = buf[:count]
        _fill_tile(tile, gen, _mix64(key ^ _mix64(flat)), decl)
        src = tuple(slice(max(sl.start, a) - a, min(sl.stop, a + e) - a)
                    for sl, a, e in zip(slices, lo, extent))
        dst = tuple(slice(max(sl.start, a) - sl.start, min(sl.stop, a + e) - sl.start)
                    for sl, a, e in zip(slices, lo, extent))
        block[dst].copy_(tile.view(extent)[src])
    return block.to(dtype=decl.dtype, device=device)


def init_params(decls: Any, *, seed: int = 0, mesh: Mesh | None = None, rules: Rules | None = None,
                rank: int | None = None, device=None) -> Any:
    """Materialise a tree of :class:`Param` declarations: the full tree without a mesh, or
    the shards of ``rank`` (default: the running device) under ``mesh`` and ``rules``."""
    seed = check_seed(seed, "init: seed")
    if mesh is not None and rank is None:
        from functional_pp.core.runtime import current_rank
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
    from functional_pp.core.runtime import current_context

    if mesh is not None and current_context(required=False) is not None:
        # this device's shards (a batched simulation: every device's, stacked; devices/batched_run.py)
        from functional_pp.devices.mesh_view import per_device
        return per_device(lambda: _init_here(init_fn, args, seed, mesh, rules, device, kwargs))
    return _init_here(init_fn, args, seed, mesh, rules, device, kwargs)


def _init_here(init_fn: Callable[..., Any], args: tuple, seed: int, mesh: Mesh | None, rules: Rules | None,
               device, kwargs: dict) -> Any:
    """:func:`init` on the device running it (or on none, ``mesh`` None)."""
    from functional_pp.parallel.named import Named

    decls = init_fn(*args, **kwargs)
    tensors = init_params(decls, seed=seed, mesh=mesh, rules=rules, device=device)
    rules = rules or Rules()

    def wrap(p, x, d):
        return Named(x, d.dims, rules.resolve(d.dims, d.shape, mesh, name=p) if mesh is not None else None,
                     sizes=d.shape, is_param=True)
    return map_with_path(wrap, tensors, decls)
