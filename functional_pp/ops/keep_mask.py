"""Counter-based keep masks: a hash (splitmix64's finaliser) of a seed and each entry's global
coordinates, so the same entry gets the same bit on every layout (``ops.dropout``, attention's
``dropout``, the masked-diffusion objective's noise: ``models/diffusion_lm.py``)."""
from __future__ import annotations

import torch

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


def uniform(seed: int | torch.Tensor, coords: list[torch.Tensor]) -> torch.Tensor:
    """A uniform draw in [0, 1) (float64, 53 bits) per entry: a counter-based hash of ``seed`` and
    each entry's global coordinates ``coords`` (integer tensors broadcasting to the result's
    shape, taken in order), so the same entry draws the same number on every layout."""
    z = torch.zeros((), dtype=torch.int64, device=coords[0].device if coords else None)
    z = z + torch.as_tensor(seed, dtype=torch.int64) * _GOLDEN
    for idx in coords:
        z = _mix(z + (idx.to(torch.int64) + 1) * _GOLDEN)
    return ((z >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)


def keep_mask(seed: int | torch.Tensor, coords: list[torch.Tensor], rate: float) -> torch.Tensor:
    """The boolean keep mask (True with probability 1 - ``rate``) of :func:`uniform`'s draws at
    ``seed`` and the entries' global coordinates ``coords``: the same entry gets the same bit on
    every layout."""
    return uniform(seed, coords) >= rate


def check_rate(rate: float, where: str = "dropout") -> float:
    """``rate`` as a float in [0, 1), else a ValueError naming ``where``."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
        raise ValueError(f"{where}: rate must be in [0, 1) (a number), got {rate!r}")
    return float(rate)
