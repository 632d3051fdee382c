"""The Mamba2 mixer (state space duality, SSD; Dao & Gu 2024) as a pure function over named
arrays: the token mixer of the hybrid families (Nemotron-H, Falcon-H1, Granite 4), equal to
transformers' ``torch_forward`` path (``NemotronHMamba2Mixer``, ``Mamba2Mixer``).

The input projection is one parameter per role (HF fuses them in ``in_proj``: gate z, x, B, C,
dt, in that order along its rows), so every head's weights carry their dimensions by name:
heads are ``ssm_groups x ssm_group_heads`` (the heads sharing one group's B and C), each of
``ssm_head_dim`` entries; B and C are ``ssm_groups x ssm_state``. A rule ``ssm_group_heads="tp"``
(``llama.default_rules``) shards the heads of each group, whatever ``n_groups`` (the gated norm,
over a group, then sums across devices; B and C whole on each); ``ssm_groups="tp"`` shards whole
groups with their heads where ``n_groups`` divides (no communication inside the mixer). Either way
the out projection's partial sums complete as attention's do.

The causal depthwise convolution is ``ops.linear_attention.causal_conv1d`` and the chunked scan is
written from the public ops (slices, a cumulative sum, einsums with masks), so their gradients are
autograd's. The scan takes the state before its first position and gives the one after its last,
so a sequence split over ``cp`` (context parallelism) runs as a chain of blocks, each from the state
the block before it ended in (ops/sequence_chain.py); sequence parallelism gathers the sequence
before the mixer, as before attention."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.ops.linear_attention import causal_conv1d
from functional_pp.ops.sequence_chain import along_sequence
from functional_pp.parallel.named import Named, make_named, wrap

HEADS = "ssm_groups ssm_group_heads"
"""The dimensions of the heads (groups, then the heads of each group)."""
X = f"batch seq {HEADS} ssm_head_dim"
BC = "batch seq ssm_groups ssm_state"


NORMS = ("gated", "before_gate", "none")


@dataclass(frozen=True)
class Mamba2:
    """The shape and constants of a Mamba2 mixer: ``heads`` heads of ``head_dim`` in ``groups``
    groups (B and C shared by a group's heads), a state of ``state`` entries per head, a causal
    convolution of ``conv_kernel`` taps, the scan's ``chunk`` (transformers' ``chunk_size``), the
    time step's limits (``time_step_limit``), the gated norm's ``eps``, and biases of the
    convolution (``use_conv_bias``) and of the projections (``use_bias``)."""
    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int = 4
    chunk: int = 128
    dt_limit: tuple[float, float] = (0.0, math.inf)
    eps: float = 1e-5
    conv_bias: bool = True
    proj_bias: bool = False
    # Falcon-H1's muP multipliers: of the input (ssm_in_multiplier) and of the projections' outputs z, x, B, C
    # and dt (ssm_multipliers, transformers' mup_vector); the gate and norm of the output: "gated"
    # (norm(y * silu(z)) * w over each group: MambaRMSNormGated), "before_gate" (norm(y) * w * silu(z)), "none"
    # (y * silu(z), no weight: Falcon-H1's mamba_rms_norm false)
    in_scale: float = 1.0
    part_scales: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    norm: str = "gated"

    def __post_init__(self) -> None:
        for key in ("heads", "head_dim", "groups", "state", "conv_kernel", "chunk"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"mamba2: {key} must be a positive integer, got {v!r}")
        if self.heads % self.groups:
            raise ValueError(f"mamba2: n_groups={self.groups} must divide the heads ({self.heads}): each group's B "
                             f"and C serve heads / n_groups heads")
        object.__setattr__(self, "dt_limit", tuple(float(x) for x in self.dt_limit))
        if len(self.dt_limit) != 2 or not self.dt_limit[0] <= self.dt_limit[1]:
            raise ValueError(f"mamba2: time_step_limit {self.dt_limit} must be (low, high) with low <= high")
        object.__setattr__(self, "part_scales", tuple(float(x) for x in self.part_scales))
        if len(self.part_scales) != 5:
            raise ValueError(f"mamba2: ssm_multipliers {list(self.part_scales)} must be 5 numbers (z, x, B, C, dt)")
        if self.norm not in NORMS:
            raise ValueError(f"mamba2: norm {self.norm!r} is not one of {', '.join(NORMS)}")

    @property
    def group_heads(self) -> int:
        return self.heads // self.groups

    @property
    def inner(self) -> int:
        """The mixer's width, heads x head_dim (transformers' ``intermediate_size``)."""
        return self.heads * self.head_dim


def init(m: Mamba2, hidden: int, dtype: torch.dtype = torch.float32, std: float = 0.02,
         out_std: float | None = None) -> dict:
    """The mixer's parameter declarations (names: :data:`functional_pp.models.llama_hf`'s table)."""
    G, H, P, N, K = m.groups, m.group_heads, m.head_dim, m.state, m.conv_kernel

    def w(shape, dims, s=std, **kw):
        return param(shape, dims, init="normal", scale=s, dtype=dtype, **kw)

    def const(shape, dims, init, scale=0.0):
        return param(shape, dims, init=init, scale=scale, dtype=dtype)
    heads = f"{HEADS} ssm_head_dim"
    p = {"z_proj": w((hidden, G, H, P), f"hidden {heads}"), "x_proj": w((hidden, G, H, P), f"hidden {heads}"),
         "b_proj": w((hidden, G, N), "hidden ssm_groups ssm_state"),
         "c_proj": w((hidden, G, N), "hidden ssm_groups ssm_state"),
         "dt_proj": w((hidden, G, H), f"hidden {HEADS}"),
         "conv_x": w((G, H, P, K), f"{heads} conv_kernel", 0.5),
         "conv_b": w((G, N, K), "ssm_groups ssm_state conv_kernel", 0.5),
         "conv_c": w((G, N, K), "ssm_groups ssm_state conv_kernel", 0.5),
         # A = -exp(A_log) = -1, D = 1 and dt = softplus(dt_bias) = the geometric middle of 1e-3 and 1e-1
         "A_log": const((G, H), HEADS, "zeros"), "D": const((G, H), HEADS, "ones"),
         "dt_bias": const((G, H), HEADS, "constant", math.log(math.expm1(0.01))),
         **({"norm": const((G, H, P), heads, "ones")} if m.norm != "none" else {}),
         # (meta in_dims: the leading dimensions the out projection contracts, docs/adapters.md)
         "out_proj": dataclasses.replace(w((G, H, P, hidden), f"{heads} hidden", out_std or std), meta={"in_dims": 3})}
    if m.conv_bias:
        p.update(conv_x_bias=const((G, H, P), heads, "zeros"),
                 conv_b_bias=const((G, N), "ssm_groups ssm_state", "zeros"),
                 conv_c_bias=const((G, N), "ssm_groups ssm_state", "zeros"))
    if m.proj_bias:
        p.update(z_bias=const((G, H, P), heads, "zeros"), x_bias=const((G, H, P), heads, "zeros"),
                 b_bias=const((G, N), "ssm_groups ssm_state", "zeros"),
                 c_bias=const((G, N), "ssm_groups ssm_state", "zeros"), dt_proj_bias=const((G, H), HEADS, "zeros"),
                 out_bias=const((hidden,), "hidden", "zeros"))
    for key in ("conv_x", "conv_b", "conv_c", "A_log", "D", "dt_bias", "norm"):    # (not linears: no all-linear
        if key in p:                                                             # LoRA target, as peft's)
            p[key] = dataclasses.replace(p[key], meta={"linear": False})
    return p


def flops_per_token(m: Mamba2, hidden: int) -> float:
    """Forward FLOPs per token of one mixer: its projections and, in a chunk of ``m.chunk``
    positions, the scan's C.B scores and their product with x (half of it: causal), the chunk's
    state and its output (the convolution and elementwise work left out)."""
    proj = 2 * hidden * (2 * m.inner + 2 * m.groups * m.state + m.heads) + 2 * m.inner * hidden
    scan = 2 * m.chunk * (m.groups * m.state + m.inner) / 2 + 2 * 2 * m.inner * m.state
    return proj + scan


def mixer(p: dict, h: Named, m: Mamba2, segments: Named | None = None) -> Named:
    """The mixer of normed input ``h`` (``batch seq hidden``; the sequence whole, or split over ``cp``):
    ``batch seq hidden``, with the out projection's pending sum where the heads are split (TP).
    ``segments`` (``batch seq`` document ids of packed rows, each document contiguous): nothing flows
    from one document into the next, neither through the convolution nor through the state (as each alone)."""
    if m.in_scale != 1:
        h = h * m.in_scale

    def proj(name: str, out: str, bias: str, scale: float) -> Named:
        y = ops.einsum(f"batch seq hidden, hidden {out} -> batch seq {out}", h, p[name])
        y = y + p[bias] if bias in p else y
        return y if scale == 1 else y * scale
    z, x, b, c, dt = (proj(name, out, bias, scale) for (name, out, bias), scale in zip((
        ("z_proj", f"{HEADS} ssm_head_dim", "z_bias"), ("x_proj", f"{HEADS} ssm_head_dim", "x_bias"),
        ("b_proj", "ssm_groups ssm_state", "b_bias"), ("c_proj", "ssm_groups ssm_state", "c_bias"),
        ("dt_proj", HEADS, "dt_proj_bias")), m.part_scales))
    x, b, c = (ops.silu(causal_conv(v, p[f"conv_{k}"], p.get(f"conv_{k}_bias"), segments))
               for v, k in ((x, "x"), (b, "b"), (c, "c")))
    y = scan(x, dt, b, c, p["A_log"], p["D"], p["dt_bias"], m, segments)
    y = gated_norm(y, z, p.get("norm"), m.eps, m.norm)
    out = ops.einsum(f"{X}, {HEADS} ssm_head_dim hidden -> batch seq hidden", y, p["out_proj"])
    return out + p["out_bias"] if "out_bias" in p else out


def _same(a: Named, b: Named, dtype: torch.dtype) -> Named:
    """1 where two arrays of document ids are equal, else 0 (in ``dtype``)."""
    return (a - b).map(lambda t: (t == 0).to(dtype))


def causal_conv(x: Named, weight: Named, bias: Named | None, segments: Named | None = None) -> Named:
    """The causal depthwise convolution along ``seq`` of every channel of ``x`` (its dimensions
    besides batch and seq), ``weight`` the channels' taps along ``conv_kernel``
    (``ops.linear_attention.causal_conv1d``: ``nn.Conv1d`` with K - 1 padding, its first outputs
    kept; with ``segments`` the taps of another document read zero), plus ``bias``."""
    out = causal_conv1d(x, weight, seq="seq", kernel="conv_kernel", segments=segments)
    return out if bias is None else out + bias


def _pad_seq(x: Named, n: int) -> Named:
    """``x`` with ``n`` zero positions after its sequence."""
    if not n:
        return x
    zero = ops.slice_dim(x, "seq", 0, 1) * 0.0
    return ops.concat([x] + [zero] * n, "seq")


def _tril(n: int, diagonal: int, rows: str, cols: str, device) -> Named:
    """The mask ``rows >= cols + diagonal`` over two named dimensions of size ``n`` (replicated)."""
    return wrap(torch.ones(n, n, dtype=torch.bool, device=device).tril(-diagonal), f"{rows} {cols}")


def scan(x: Named, dt: Named, b: Named, c: Named, a_log: Named, d: Named, dt_bias: Named, m: Mamba2,
         segments: Named | None = None) -> Named:
    """The SSD scan: per head, the state ``s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T`` and the
    output ``y_t = s_t C_t + D x_t`` with ``dt = clamp(softplus(dt + dt_bias), *dt_limit)`` and
    ``A = -exp(A_log)``, in float32 for 16-bit inputs (as transformers); along the sequence by
    :func:`ops.sequence_chain.along_sequence` (the blocks of a split sequence in order, the state
    handed on), each block by :func:`scan_block`."""
    dtype = x.data.dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x, dt, b, c = (v.astype(wide) for v in (x, dt, b, c))
    dt = (dt + dt_bias.astype(wide)).map(F.softplus)
    if m.dt_limit != (0.0, math.inf):
        lo, hi = m.dt_limit
        dt = dt.map(lambda t: t.clamp(lo, hi))
    a = -ops.exp(a_log.astype(wide))
    xs, adt = x * dt, dt * a

    def step(blocks, shared, state):
        y, final, last_id = scan_block(*blocks, state[0], state[1] if len(state) > 1 else None, m.chunk)
        return (y,), [final] + ([] if last_id is None else [last_id])
    state = [_zero_state(xs, b)]
    if segments is not None:            # (the document before the row: an id no document has)
        split = segments.split[segments.dims.index("batch")]
        local = segments.data.shape[segments.dims.index("batch")]
        state.append(make_named(torch.full((local,), -2, dtype=segments.data.dtype, device=segments.data.device),
                                ("batch",), (split,), segments.vary))
    y = along_sequence(step, [xs, b, c, adt, segments], state, seq="seq", op="mamba2 scan")[0]
    return y + x * d.astype(wide)


def _zero_state(xs: Named, b: Named) -> Named:
    """The zero state (``batch heads ssm_head_dim ssm_state``), laid out as the scan's heads and ``b``'s state."""
    dims = ("batch", *HEADS.split(), "ssm_head_dim", "ssm_state")
    lay = {**dict(zip(b.dims, zip(b.data.shape, b.split))), **dict(zip(xs.dims, zip(xs.data.shape, xs.split)))}
    return make_named(xs.data.new_zeros([lay[n][0] for n in dims]), dims,
                      tuple(lay[n][1] for n in dims),
                      xs.vary | b.vary)


def scan_block(xs: Named, b: Named, c: Named, adt: Named, segments: Named | None, start_state: Named,
               start_id: Named | None, chunk: int) -> tuple[Named, Named, Named | None]:
    """The scan of one block of the sequence (``xs`` = dt x, ``adt`` = dt A, the sequence whole) from
    ``start_state`` (``batch heads ssm_head_dim ssm_state``, the state before the block; with ``segments``
    it belongs to document ``start_id``, ``batch``): its output without the D term, the state after its
    last position and that position's document id. In chunks of ``chunk`` positions (quadratic inside a
    chunk, states passed between chunks). With ``segments`` the state starts from zero at each
    document: source s reaches target l only in the same document, which (documents contiguous) holds
    at every step between them: inside a chunk, s to its chunk's end, one chunk's end to a later chunk's
    start, that start to l."""
    S = xs.size("seq")
    L = min(chunk, S)                      # (a shorter chunk: the same sums, no padding to m.chunk)
    pad = -S % L
    n = (S + pad) // L
    wide = xs.data.dtype

    def chunked(v: Named) -> Named:
        return ops.split_dim(_pad_seq(v, pad), "seq", {"ssd_chunk": n, "ssd_pos": L})
    xs, bs, cs, adt = (chunked(v) for v in (xs, b, c, adt))
    acum = ops.cumsum(adt, "ssd_pos")                                  # batch ssd_chunk ssm_groups ... ssd_pos
    dev = xs.data.device
    # 1. inside each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(acum_l - acum_s) dt_s x_s
    seg = ops.exp(ops.where(_tril(L, 0, "ssd_pos", "ssd_src", dev),
                            acum - ops.rename(acum, ssd_pos="ssd_src"), -math.inf))
    if segments is not None:        # (document ids per chunk and position; the padding's: the last one's)
        last_id = ops.slice_dim(segments, "seq", S - 1, S)
        ids = ops.split_dim(ops.concat([segments] + [last_id] * pad, "seq") if pad else segments, "seq",
                            {"ssd_chunk": n, "ssd_pos": L})
        seg = seg * _same(ids, ops.rename(ids, ssd_pos="ssd_src"), wide)
        end, start = ops.take(ids, "ssd_pos", L - 1), ops.take(ids, "ssd_pos", 0)
    scores = ops.einsum("batch ssd_chunk ssd_pos ssm_groups ssm_state, batch ssd_chunk ssd_src ssm_groups ssm_state "
                        "-> batch ssd_chunk ssm_groups ssd_pos ssd_src", cs, ops.rename(bs, ssd_pos="ssd_src"))
    y = ops.einsum(f"batch ssd_chunk {HEADS} ssd_pos ssd_src, batch ssd_chunk ssd_src {HEADS} ssm_head_dim "
                   f"-> batch ssd_chunk ssd_pos {HEADS} ssm_head_dim", scores * seg, ops.rename(xs, ssd_pos="ssd_src"))
    # 2. each chunk's own contribution to the state at its end
    last = ops.take(acum, "ssd_pos", L - 1)                            # batch ssd_chunk heads
    to_end = ops.exp(last - acum)
    if segments is not None:
        to_end = to_end * _same(ids, end, wide)
    states = ops.einsum(f"batch ssd_chunk ssd_pos ssm_groups ssm_state, batch ssd_chunk {HEADS} ssd_pos, "
                        f"batch ssd_chunk ssd_pos {HEADS} ssm_head_dim "
                        f"-> batch ssd_chunk {HEADS} ssm_head_dim ssm_state", bs, to_end, xs)
    # 3. the state at each chunk's start (and after the last): the block's start state and the earlier
    # chunks' states, decayed through the chunks between
    total = ops.cumsum(last, "ssd_chunk")                              # log decay from the block's start to a chunk's end
    ends = ops.concat([total - last, ops.slice_dim(total, "ssd_chunk", n - 1, n)], "ssd_chunk")    # n + 1 points
    from_block = ops.exp(ends)
    if segments is not None:                                           # (the document at each of those points)
        firsts = ops.concat([start, ops.slice_dim(end, "ssd_chunk", n - 1, n)], "ssd_chunk")
        from_block = from_block * _same(firsts, start_id, wide)
    state_in = ops.einsum(f"batch ssd_chunk {HEADS}, batch {HEADS} ssm_head_dim ssm_state "
                          f"-> batch ssd_chunk {HEADS} ssm_head_dim ssm_state", from_block, start_state)
    earlier = wrap(torch.ones(n + 1, n, dtype=torch.bool, device=dev).tril(-1), "ssd_chunk ssd_from")
    decay = ops.exp(ops.where(earlier,
                              ends - ops.rename(total, ssd_chunk="ssd_from"), -math.inf))
    if segments is not None:
        decay = decay * _same(firsts, ops.rename(end, ssd_chunk="ssd_from"), wide)
    state_in = state_in + ops.einsum(f"batch ssd_chunk ssd_from {HEADS}, batch ssd_from {HEADS} ssm_head_dim "
                                     f"ssm_state -> batch ssd_chunk {HEADS} ssm_head_dim ssm_state", decay,
                                     ops.rename(states, ssd_chunk="ssd_from"))
    final = ops.take(state_in, "ssd_chunk", n)
    state_in = ops.slice_dim(state_in, "ssd_chunk", 0, n)
    # 4. the start state's output in each chunk, decayed to each position
    from_start = ops.exp(acum) if segments is None else ops.exp(acum) * _same(ids, start, wide)
    y = y + ops.einsum(f"batch ssd_chunk ssd_pos ssm_groups ssm_state, batch ssd_chunk {HEADS} ssm_head_dim "
                       f"ssm_state -> batch ssd_chunk ssd_pos {HEADS} ssm_head_dim", cs, state_in) * from_start
    y = ops.merge_dims(ops.transpose(y, "batch", "ssd_chunk", "ssd_pos", *HEADS.split(), "ssm_head_dim"),
                       ("ssd_chunk", "ssd_pos"), "seq")
    if pad:
        y = ops.slice_dim(y, "seq", 0, S)
    return y, final, None if segments is None else ops.take(segments, "seq", S - 1)


def gated_norm(y: Named, z: Named, weight: Named | None, eps: float, norm: str = "gated") -> Named:
    """transformers' ``MambaRMSNormGated`` (``norm`` "gated"): ``y * silu(z)`` RMS-normed over each
    group of heads (``ssm_group_heads x ssm_head_dim``), in float32 for 16-bit inputs, times
    ``weight``; "before_gate": ``norm(y) * weight * silu(z)``; "none": ``y * silu(z)``."""
    wide = torch.float32 if z.data.dtype in (torch.float16, torch.bfloat16) else z.data.dtype
    gate = ops.silu(z.astype(wide))
    if norm == "none":
        return (y.astype(wide) * gate).astype(z.data.dtype)
    group = ("ssm_group_heads", "ssm_head_dim")
    if norm == "before_gate":
        return ((ops.rms_norm(y.astype(wide), dim=group, eps=eps) * weight) * gate).astype(z.data.dtype)
    return ops.rms_norm(y.astype(wide) * gate, dim=group, eps=eps).astype(z.data.dtype) * weight
