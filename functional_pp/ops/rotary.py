"""Rotary position embedding (rotate-half convention of Hugging Face Llama), with Llama 3
frequency scaling, applied at global positions whatever the sequence layout."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..named import Named, _memo, settle
from .regather import relayout


@dataclass(frozen=True)
class Llama3Scaling:
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def inverse_frequencies(head_dim: int, theta: float, scaling: Llama3Scaling | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies (float64), Llama-3 scaled when ``scaling`` is given."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)


def rotary(x: Named, positions: Named, *, theta: float = 10000.0, scaling: Llama3Scaling | None = None,
           seq: str = "seq", head_dim: str = "head_dim") -> Named:
    """Rotate pairs (i, i + d/2) of ``head_dim`` by angle position * inv_freq_i."""
    x = settle(x)
    si, di = x.dims.index(seq), x.dims.index(head_dim)
    if x.split[di]:
        raise ValueError(f"rotary: {head_dim!r} must not be split")
    pos = relayout(positions, (x.split[si],))
    d = x.data.shape[di]
    cos, sin = _tables(pos, d, theta, scaling, x.data.device)
    shape = [1] * x.data.ndim
    shape[si], shape[di] = cos.shape[0], d
    if si > di:
        cos, sin = cos.T, sin.T
    cos, sin = cos.reshape(shape), sin.reshape(shape)

    def apply(t):
        tf = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
        x1, x2 = tf.chunk(2, dim=di)
        rot = torch.cat([-x2, x1], dim=di)
        c, s = (cos, sin) if cos.dtype == tf.dtype else (cos.to(tf.dtype), sin.to(tf.dtype))
        out = tf * c + rot * s
        return out if out.dtype == t.dtype else out.to(t.dtype)
    return x.map(apply)


def _tables(pos: Named, d: int, theta: float, scaling: Llama3Scaling | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq, d), float32, of the angles position * inv_freq computed in float64;
    built once per positions value and reused by q and k of every layer (memoised beside the
    positions value, docs/named_value.md)."""
    key = ("rotary", d, theta, scaling, device, pos.data._version)
    memo = None if torch.compiler.is_compiling() else _memo(pos)     # no tensors kept across traces
    if memo is not None and key in memo:
        return memo[key]
    inv = inverse_frequencies(d, theta, scaling).to(device)
    ang = pos.data.to(device=device, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    tables = (torch.cat([cos, cos], -1).to(torch.float32), torch.cat([sin, sin], -1).to(torch.float32))
    if memo is not None:
        memo[key] = tables
    return tables
