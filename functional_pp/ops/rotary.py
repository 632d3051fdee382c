"""Rotary position embedding (rotate-half convention of Hugging Face Llama), with Llama 3
frequency scaling, applied at global positions whatever the sequence layout."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from functional_pp._torch import is_tracing
from functional_pp.compile.barrier import materialize
from functional_pp.ops.regather import relayout
from functional_pp.parallel.named import Named, _make, _memo, settle

# marks a positions value built while torch.compile traces: its rotary tables may be memoised on
# it for that trace (the value dies with the trace; docs/rotary.md)
TRACED_POSITIONS = "traced positions"


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


def rotary(x: Named, positions: Named, *, head_dim: str, theta: float = 10000.0,
           scaling: Llama3Scaling | None = None, seq: str | None = None) -> Named:
    """Rotate pairs (i, i + d/2) of ``head_dim`` by angle position * inv_freq_i; ``seq`` is the
    dimension of ``positions`` (its only one) unless named."""
    if seq is None:
        seq = positions.dims[0] if isinstance(positions, Named) and len(positions.dims) == 1 else None
        if seq is None:
            raise ValueError("rotary: positions must be a named array with one dimension (ops.positions), "
                             "or name the sequence dimension: rotary(..., seq='...')")
    if not isinstance(x, Named) or x._partial:     # (settle names an unnamed operand)
        x = settle(x)
    dims, split, data = x._dims, x._split, x._data
    si, di = dims.index(seq), dims.index(head_dim)
    if split[di]:
        raise ValueError(f"rotary: {head_dim!r} must not be split")
    pos = relayout(positions, (split[si],))
    cos, sin = _tables(pos, data.shape[di], theta, scaling, data.device, si, di, data.ndim)
    return _make(_rotate(data, cos, sin, di), dims, split, x._vary, x._partial, x._sizes)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, di: int) -> torch.Tensor:
    tf = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    # rotate-half, (x1, x2) -> (-x2, x1): a roll by d/2 with the sign in the sin table (one op
    # forward and backward instead of chunk, neg and cat; the same values, docs/rotary.md)
    rot = tf.roll(tf.shape[di] // 2, di)
    c, s = (cos, sin) if cos.dtype == tf.dtype else (cos.to(tf.dtype), sin.to(tf.dtype))
    out = tf * c + rot * s
    return out if out.dtype == t.dtype else out.to(t.dtype)


def _tables(pos: Named, d: int, theta: float, scaling: Llama3Scaling | None, device, si: int, di: int,
            ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles position * inv_freq computed in float64, float32 (sin negated in
    the first half: the sign of rotate-half, :func:`_rotate`), shaped to
    broadcast against a block of ``ndim`` dimensions with the sequence at ``si`` and the head
    dimension at ``di``; built once per positions value and reused by q and k of every layer
    (memoised beside the positions value, docs/named_value.md). Traced (torch.compile), they are
    built once per trace of a positions value made in that trace and materialised, so that the
    compiled step computes them once and every layer reads them (docs/rotary.md)."""
    tracing = is_tracing()
    if not tracing:
        key = ("rotary", d, theta, scaling, device, pos._data._version, si, di, ndim)
        memo = _memo(pos)
    else:   # only a value built in this trace holds tables (no tensors kept across traces)
        key = ("rotary", d, theta, scaling, device, si, di, ndim)
        memo = pos._derived if pos._derived is not None and pos._derived.get(TRACED_POSITIONS) else None
    if memo is not None:
        tables = memo.get(key)
        if tables is not None:
            return tables
    inv = inverse_frequencies(d, theta, scaling).to(device)
    ang = pos.data.to(device=device, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    cos, sin = torch.cat([cos, cos], -1).to(torch.float32), torch.cat([-sin, sin], -1).to(torch.float32)
    shape = [1] * ndim
    shape[si], shape[di] = cos.shape[0], d
    if si > di:
        cos, sin = cos.T, sin.T
    tables = cos.reshape(shape), sin.reshape(shape)
    if memo is not None:
        if tracing:     # shared by every layer: an opaque copy, that the compiler cannot inline into each use
            tables = materialize(tables[0]), materialize(tables[1])
        memo[key] = tables
    return tables
