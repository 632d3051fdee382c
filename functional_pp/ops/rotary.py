"""Rotary position embedding (rotate-half convention of Hugging Face Llama), with Llama 3
frequency scaling, LongRoPE (Phi-3), linear interpolation (Gemma 3) or YaRN (Qwen), applied at
global positions whatever the sequence layout."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from functional_pp._torch import is_tracing
from functional_pp.compile.barrier import materialize
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.named import Named, make_named, memo_table, settle

# marks a positions value built while torch.compile traces: its rotary tables may be memoised on
# it for that trace (the value dies with the trace; docs/rotary.md)
TRACED_POSITIONS = "traced positions"


@dataclass(frozen=True)
class Llama3Scaling:
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (Phi-3 128k, Phi-3.5): per-pair divisors of the frequencies, ``short_factor``
    for sequences of at most ``original_max_position`` tokens, ``long_factor`` beyond, and the
    cos / sin tables multiplied by ``attention_factor``."""
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position: int
    attention_factor: float = 1.0

    def __post_init__(self) -> None:         # lists from YAML / JSON
        object.__setattr__(self, "short_factor", tuple(float(x) for x in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(x) for x in self.long_factor))
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"LongRopeScaling: short_factor has {len(self.short_factor)} entries, long_factor "
                             f"{len(self.long_factor)}")


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation: every frequency divided by ``factor`` (Gemma 3's global layers)."""
    factor: float


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Qwen2.5 / Qwen3 long context): frequencies interpolated by ``factor`` below the
    correction range of ``beta_fast`` / ``beta_slow`` rotations over ``original_max_position``
    positions, kept above it, ramped between; tables times ``attention_factor`` (transformers'
    ``_compute_yarn_parameters``)."""
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ProportionalScaling:
    """Proportional rope (Gemma 4's full layers): only the first ``partial_rotary_factor * d / 2``
    pairs (i, i + d/2) of a head of width ``d`` rotate, at the frequencies of a head of that full
    width (``theta ** (-2i / d)``); the other pairs have frequency 0 (they pass through); every
    frequency divided by ``factor`` (transformers' ``_compute_proportional_rope_parameters``)."""
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.partial_rotary_factor <= 1:
            raise ValueError(f"ProportionalScaling: partial_rotary_factor={self.partial_rotary_factor} must be in "
                             f"[0, 1]")


RopeScaling = Llama3Scaling | LongRopeScaling | LinearScaling | YarnScaling | ProportionalScaling


def _yarn(inv: torch.Tensor, head_dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                   # (as transformers: no singularity)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=inv.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                     # the share of the unscaled frequency
    return inv / s.factor * (1 - keep) + inv * keep


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                        seq_len: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies (float64, made on ``device``), Llama-3 or LongRoPE scaled
    when ``scaling`` is given (LongRoPE: the long factors when ``seq_len`` exceeds the original
    context)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    if scaling is None:
        return inv
    if isinstance(scaling, LinearScaling):
        return inv / scaling.factor
    if isinstance(scaling, ProportionalScaling):        # the pairs past the rotating share: frequency 0
        rotating = int(scaling.partial_rotary_factor * head_dim // 2)
        return torch.where(torch.arange(inv.numel(), device=inv.device) < rotating, inv, 0.0) / scaling.factor
    if isinstance(scaling, YarnScaling):
        return _yarn(inv, head_dim, theta, scaling)
    if isinstance(scaling, LongRopeScaling):
        if len(scaling.short_factor) != head_dim // 2:
            raise ValueError(f"LongRoPE: {len(scaling.short_factor)} factors for a head_dim of {head_dim} "
                             f"({head_dim // 2} pairs)")
        long = seq_len is not None and seq_len > scaling.original_max_position
        return inv / torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float64,
                                  device=inv.device)
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)


def mrope_sections(section: tuple[int, ...], interleaved: bool, pairs: int) -> tuple[int, ...]:
    """The position component (0 temporal, 1 height, 2 width) of each of ``pairs`` rotating pairs of
    a multimodal rotary of ``mrope_section`` pairs per component: contiguous (Qwen2-VL: the first
    ``section[0]`` pairs temporal, then height, then width; they must add up to ``pairs``) or
    ``interleaved`` (Qwen3-VL, Qwen3.5: pair i of ``i % 3 == 1`` below ``3 * section[1]`` height, of
    ``i % 3 == 2`` below ``3 * section[2]`` width, the others temporal, as transformers)."""
    n = pairs
    if len(section) != 3:
        raise ValueError(f"mrope_section {list(section)} must have 3 entries (temporal, height, width)")
    if not interleaved:
        if sum(section) != pairs:
            raise ValueError(f"mrope_section {list(section)} adds up to {sum(section)} pairs, the rotary has {pairs}")
        return tuple(c for c, k in enumerate(section) for _ in range(k))
    return tuple(1 if i % 3 == 1 and i < 3 * section[1] else 2 if i % 3 == 2 and i < 3 * section[2] else 0
                 for i in range(n))


def rotary(x: Named, positions: Named, *, head_dim: str, theta: float = 10000.0,
           scaling: RopeScaling | None = None, seq: str | None = None, rotary_dim: int | None = None,
           interleaved: bool = False, sections: tuple[int, ...] | None = None) -> Named:
    """Rotate pairs (i, i + d/2) of ``head_dim`` by angle position * inv_freq_i; ``seq`` is the
    first dimension of ``positions`` unless named. ``positions`` may have more dimensions of
    ``x`` after it (``seq batch``: each row's own positions, left-padded prompts counted from
    their first token; docs/generation.md). ``rotary_dim`` (partial rotary:
    Phi-1/2, GPT-NeoX): only the first ``rotary_dim`` entries of ``head_dim`` rotate, as a
    head of that width (d = rotary_dim above); the others pass through. ``interleaved``
    (Cohere, GPT-J): the pairs are (2i, 2i + 1) instead, with the same frequencies. ``sections``
    (multimodal rotary, M-RoPE: Qwen2-VL, Qwen3.5): the positions' last dimension holds several
    components (temporal, height, width) and pair i rotates by component ``sections[i]``
    (:func:`mrope_sections`); positions whose components are equal rotate as plain positions."""
    if not isinstance(positions, Named) or not positions.dims:
        raise ValueError("rotary: positions must be a named array (ops.positions), its first dimension the "
                         "sequence's")
    if seq is None:
        seq = positions.dims[0]
    component = positions.dims[-1] if sections is not None else None
    if not isinstance(x, Named) or x._partial:     # (settle names an unnamed operand)
        x = settle(x)
    dims, split, data = x._dims, x._split, x._data
    missing = [d for d in positions.dims if d not in dims and d != component]
    if missing or seq not in positions.dims:
        raise ValueError(f"rotary: positions {positions.dims} must have the sequence dimension {seq!r} and only "
                         f"dimensions of x {dims} (not {missing})")
    at, di = tuple(dims.index(d) for d in positions.dims if d != component), dims.index(head_dim)
    if split[di]:
        raise ValueError(f"rotary: {head_dim!r} must not be split")
    seq_len = positions.size(seq) if isinstance(scaling, LongRopeScaling) else None
    pos = relayout(positions, tuple(split[i] for i in at) + (((),) if component is not None else ()))
    d = data.shape[di] if rotary_dim is None else rotary_dim
    if d % 2 or not 0 < d <= data.shape[di]:
        raise ValueError(f"rotary: rotary_dim={rotary_dim} must be even and at most {head_dim!r}'s size "
                         f"{data.shape[di]}")
    if sections is not None and (len(sections) != d // 2 or not all(0 <= c < positions.size(component)
                                                                      for c in sections)):
        raise ValueError(f"rotary: sections has {len(sections)} entries for {d // 2} rotating pairs, each the index "
                         f"of a component of positions' {component!r} ({positions.size(component)}); check "
                         f"mrope_section against the rotary width")
    cos, sin = _tables(pos, d, theta, scaling, data.device, at, di, data.ndim, seq_len, interleaved,
                       None if sections is None else tuple(sections))
    if d == data.shape[di]:
        out = _rotate(data, cos, sin, di, interleaved)
    else:                                   # partial rotary: the rest of head_dim passes through
        out = torch.cat([_rotate(data.narrow(di, 0, d), cos, sin, di, interleaved),
                         data.narrow(di, d, data.shape[di] - d)], di)
    return make_named(out, dims, split, x._vary, x._partial, x._sizes)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, di: int, interleaved: bool = False) -> torch.Tensor:
    tf = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    # rotate-half, (x1, x2) -> (-x2, x1): a roll by d/2 with the sign in the sin table (one op
    # forward and backward instead of chunk, neg and cat; the same values, docs/rotary.md);
    # interleaved, each pair (x_2i, x_2i+1) -> (-x_2i+1, x_2i): the pairs swapped, signs in the table
    rot = tf.unflatten(di, (-1, 2)).flip(di + 1).flatten(di, di + 1) if interleaved else tf.roll(tf.shape[di] // 2, di)
    c, s = (cos, sin) if cos.dtype == tf.dtype else (cos.to(tf.dtype), sin.to(tf.dtype))
    out = tf * c + rot * s
    return out if out.dtype == t.dtype else out.to(t.dtype)


def _tables(pos: Named, d: int, theta: float, scaling: RopeScaling | None, device, at: tuple[int, ...], di: int,
            ndim: int, seq_len: int | None = None, interleaved: bool = False,
            sections: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles position * inv_freq computed in float64, float32 (sin negated in
    the first half: the sign of rotate-half, :func:`_rotate`), shaped to
    broadcast against a block of ``ndim`` dimensions with the positions' dimensions at ``at`` and
    the head dimension at ``di``; built once per positions value and reused by q and k of every layer
    (memoised beside the positions value, docs/named_value.md). Traced (torch.compile), they are
    built once per trace of a positions value made in that trace and materialised, so that the
    compiled step computes them once and every layer reads them (docs/rotary.md)."""
    tracing = is_tracing()
    if not tracing:
        key = ("rotary", d, theta, scaling, device, pos._data._version, at, di, ndim, seq_len, interleaved, sections)
        memo = memo_table(pos)
    else:   # only a value built in this trace holds tables (no tensors kept across traces)
        key = ("rotary", d, theta, scaling, device, at, di, ndim, seq_len, interleaved, sections)
        memo = pos._derived if pos._derived is not None and pos._derived.get(TRACED_POSITIONS) else None
    if memo is not None:
        tables = memo.get(key)
        if tables is not None:
            return tables
    inv = inverse_frequencies(d, theta, scaling, seq_len, device=device)     # on the device: no host work
    ang = pos.data.to(device=device, dtype=torch.float64)[..., None] * inv
    if sections is not None:    # M-RoPE: pair i's angle from component sections[i] (the positions' last dimension)
        pick = torch.tensor(sections, device=device).expand(*ang.shape[:-2], 1, -1)
        ang = ang.gather(-2, pick).squeeze(-2)
    cos, sin = ang.cos(), ang.sin()
    attention_factor = getattr(scaling, "attention_factor", 1.0)      # LongRoPE, YaRN
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    if interleaved:             # entry 2i and 2i + 1 of pair i; the sign of the swapped pair in sin
        cos, sin = cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)
    else:
        cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    cos, sin = cos.to(torch.float32), sin.to(torch.float32)
    shape = [1] * ndim
    for i, n in zip(at + (di,), cos.shape):
        shape[i] = n
    order = sorted(range(len(at) + 1), key=(at + (di,)).__getitem__)    # the table's dims in x's order
    tables = cos.permute(order).reshape(shape), sin.permute(order).reshape(shape)
    if memo is not None:
        if tracing:     # shared by every layer: an opaque copy, that the compiler cannot inline into each use
            tables = materialize(tables[0]), materialize(tables[1])
        memo[key] = tables
    return tables
