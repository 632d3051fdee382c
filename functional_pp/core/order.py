"""The order in which a split dimension is laid out over its devices (docs/layouts.md).

Contiguous: device i of c holds block i. Load-balanced (a :class:`~functional_pp.core.layout.balanced`
rule): the dimension is cut into 2c chunks and device i holds chunks i and 2c-1-i, which
evens out causal attention's work. A load-balanced layout is the contiguous layout of the
dimension permuted by :func:`to_balanced`; so every gather un-permutes (:func:`from_balanced`)
and every slice of a whole dimension permutes first. Both are local reorderings (no
communication) built from chunk and cat, so autograd and torch.compile follow them."""
from __future__ import annotations

import torch


def _order(c: int) -> list[int]:
    """Chunk order of the balanced layout: 0, 2c-1, 1, 2c-2, ..."""
    return [j for i in range(c) for j in (i, 2 * c - 1 - i)]


def _check(x: torch.Tensor, dim: int, c: int, name: str) -> None:
    if x.shape[dim] % (2 * c):
        raise ValueError(f"dimension {name!r} of size {x.shape[dim]} is load-balanced over {c} devices "
                         f"and needs a size divisible by {2 * c}; change the size or make its rule "
                         f"contiguous")


def to_balanced(x: torch.Tensor, dim: int, c: int, name: str = "dim") -> torch.Tensor:
    """Reorder a whole dimension so that its contiguous split over c devices is the balanced one."""
    if c == 1:
        return x
    _check(x, dim, c, name)
    chunks = x.chunk(2 * c, dim=dim)
    return torch.cat([chunks[j] for j in _order(c)], dim=dim)


def from_balanced(x: torch.Tensor, dim: int, c: int, name: str = "dim") -> torch.Tensor:
    """Inverse of :func:`to_balanced`: the gathered balanced blocks back in natural order."""
    if c == 1:
        return x
    _check(x, dim, c, name)
    chunks = x.chunk(2 * c, dim=dim)
    where = {j: k for k, j in enumerate(_order(c))}
    return torch.cat([chunks[where[j]] for j in range(2 * c)], dim=dim)


def balanced_indices(size: int, c: int, i: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Natural positions of the elements device i of c holds in a balanced layout (on ``device``)."""
    m = size // (2 * c)
    j = 2 * c - 1 - i
    return torch.cat([torch.arange(i * m, (i + 1) * m, device=device), torch.arange(j * m, (j + 1) * m, device=device)])
