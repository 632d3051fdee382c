"""Dropout whose mask depends only on the seed and each element's global coordinates, so
every layout drops the same elements as one device (docs/layouts.md)."""
from __future__ import annotations

import torch

from functional_pp.parallel.named import Named, env, settle

_MASK64 = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; logical shifts emulated)."""
    def shr(t, k):
        return (t >> k) & ((1 << (64 - k)) - 1)
    z = (z ^ shr(z, 30)) * _M1
    z = (z ^ shr(z, 27)) * _M2
    return z ^ shr(z, 31)


def _global_index(x: Named, dim: str) -> torch.Tensor:
    """Global coordinates of this device's entries of ``dim`` (in the layout's order)."""
    from functional_pp.ops.attention import _local_positions
    i = x.dims.index(dim)
    split = x.split[i]
    return _local_positions(x.size(dim), split, env()[1].splits_balanced(dim, split))


def dropout(x: Named, rate: float, seed: int | torch.Tensor, training: bool = True) -> Named:
    """Zero each element with probability ``rate`` and scale the rest by 1/(1-rate). The mask
    is a hash of ``seed`` and the element's global coordinates (dimensions taken in name
    order), so it is the same on every layout; vary ``seed`` per step and per call site."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout: rate must be in [0, 1), got {rate}")
    x = settle(x)
    if not training or rate == 0.0:
        return x
    z = torch.zeros((), dtype=torch.int64) + torch.as_tensor(seed, dtype=torch.int64) * _GOLDEN
    for d in sorted(x.dims):
        idx = _global_index(x, d).to(torch.int64)
        shape = [1] * len(x.dims)
        shape[x.dims.index(d)] = -1
        z = _mix(z + (idx.reshape(shape) + 1) * _GOLDEN)
    u = ((z >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)
    keep = (u >= rate).to(x.data.dtype)
    return Named(x.data * keep / (1.0 - rate), x.dims, x.split, x.vary)
