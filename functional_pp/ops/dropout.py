"""Dropout whose mask depends only on the seed and each element's global coordinates, so
every layout drops the same elements as one device (docs/layouts.md)."""
from __future__ import annotations

import torch

from functional_pp.ops.keep_mask import check_rate, keep_mask
from functional_pp.parallel.named import Named, env, settle


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
    check_rate(rate)
    x = settle(x)
    if not training or rate == 0.0:
        return x
    coords = []
    for d in sorted(x.dims):
        idx = _global_index(x, d)
        shape = [1] * len(x.dims)
        shape[x.dims.index(d)] = -1
        coords.append(idx.reshape(shape))
    keep = keep_mask(seed, coords, rate).to(x.data.dtype)
    return Named(x.data * keep / (1.0 - rate), x.dims, x.split, x.vary)
