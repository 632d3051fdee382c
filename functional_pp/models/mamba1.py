"""The Mamba (v1) mixer (Gu & Dao 2023), the selective state space layer of Mamba and Jamba, as a
pure function over named arrays, equal to transformers' ``MambaMixer`` / ``JambaMambaMixer``
without their CUDA kernels (the recurrent loop of ``mamba_selective_scan``).

``in_proj`` gives x and the gate z of every channel (``hidden mamba_gates mamba_inner``, HF's rows
x then z); x passes the causal depthwise convolution and SiLU; ``x_proj`` gives each position's
low-rank time step, B and C (``mamba_inner ssm_xproj``, HF's rows in that order; Jamba RMS-norms
each of the three); ``dt = softplus(dt_proj(dt_low) + dt_bias)``; per channel d and state entry n
``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = h_t . C_t + D x_t`` with ``A = -exp(A_log)``;
``out_proj(y * silu(z))``. The recurrence runs in chunks (:func:`ops.linear_scan.linear_scan`:
about ``2 sqrt(S)`` vectorized steps, the states of the loop position by position to rounding).

Channels are independent: a rule ``mamba_inner="tp"`` (``llama.default_rules``) splits them with
their convolution taps, ``A_log``, ``D`` and the time step's projection (``x_proj`` is then
row-parallel: dt, B and C are completed by a sum over ``tp``; ``out_proj`` row-parallel as
attention's). The scan runs along the sequence through
:func:`ops.sequence_chain.along_sequence`: a sequence split over devices (context parallelism) runs
block after block, the state (``batch mamba_inner ssm_state``) handed on, the convolution's last
inputs too (``causal_conv1d``). Packed rows (``segments``) restart the state and the convolution
at each document, across the blocks too."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models import mamba2
from functional_pp.ops.linear_scan import linear_scan
from functional_pp.ops.sequence_chain import along_sequence
from functional_pp.parallel.named import Named, make_named

INNER = "mamba_inner"
"""The mixer's channels (transformers' ``intermediate_size``), split over ``tp``."""


@dataclass(frozen=True)
class Mamba1:
    """The shape of a Mamba (v1) mixer: ``inner`` channels, a state of ``state`` entries per
    channel, a time step of rank ``dt_rank``, a causal convolution of ``conv_kernel`` taps, biases of
    the convolution and of the in / out projections, and Jamba's RMSNorms of dt, B and C
    (``dt_norms``, epsilon ``eps``)."""
    inner: int
    state: int
    dt_rank: int
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    dt_norms: bool = False
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for key in ("inner", "state", "dt_rank", "conv_kernel"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"mamba1: {key} must be a positive integer, got {v!r}")


def init(m: Mamba1, hidden: int, dtype: torch.dtype = torch.float32, std: float = 0.02,
         out_std: float | None = None) -> dict:
    """The mixer's parameter declarations (HF names: :data:`functional_pp.models.llama_hf`'s table)."""
    I, N, R, K = m.inner, m.state, m.dt_rank, m.conv_kernel

    def w(shape, dims, s=std):
        return param(shape, dims, init="normal", scale=s, dtype=dtype)

    def const(shape, dims, init, scale=0.0):
        return param(shape, dims, init=init, scale=scale, dtype=dtype)
    p = {"in_proj": w((hidden, 2, I), f"hidden mamba_gates {INNER}"),
         # (meta linear False: not a linear weight, so not an all-linear LoRA target, as peft's nn.Conv1d / Parameter)
         "conv": dataclasses.replace(w((I, K), f"{INNER} conv_kernel", 0.5), meta={"linear": False}),
         "x_proj": w((I, R + 2 * N), f"{INNER} ssm_xproj"),
         "dt_proj": w((R, I), f"mamba_dt_rank {INNER}", R ** -0.5),
         # dt = softplus(dt_bias) = 0.01; A = -(1, 2, ..., N) for every channel (S4D-real), D = 1
         "dt_bias": const((I,), INNER, "constant", math.log(math.expm1(0.01))),
         "A_log": dataclasses.replace(param((I, N), f"{INNER} ssm_state", init="zeros", dtype=dtype),
                                      meta={"linear": False}),
         "D": const((I,), INNER, "ones"),
         "out_proj": dataclasses.replace(w((I, hidden), f"{INNER} hidden", out_std or std), meta={"in_dims": 1})}
    if m.conv_bias:
        p["conv_bias"] = const((I,), INNER, "zeros")
    if m.proj_bias:
        p.update(in_bias=const((2, I), f"mamba_gates {INNER}", "zeros"), out_bias=const((hidden,), "hidden", "zeros"))
    if m.dt_norms:
        p.update(dt_norm=const((R,), "mamba_dt_rank", "ones"), b_norm=const((N,), "ssm_state", "ones"),
                 c_norm=const((N,), "ssm_state", "ones"))
    return p


def flops_per_token(m: Mamba1, hidden: int) -> float:
    """Forward FLOPs per token of one mixer: its projections (in, x, dt, out) and the scan's
    state update and read-out (the convolution and elementwise work left out)."""
    proj = 2 * hidden * 2 * m.inner + 2 * m.inner * (m.dt_rank + 2 * m.state) + 2 * m.dt_rank * m.inner \
        + 2 * m.inner * hidden
    return proj + 3 * 2 * m.inner * m.state


def mixer(p: dict, h: Named, m: Mamba1, segments: Named | None = None) -> Named:
    """The mixer of normed input ``h`` (``batch seq hidden``; the sequence whole or split, CP): ``batch seq
    hidden``, with the out projection's pending sum where the channels are split (TP). ``segments``
    (``batch seq`` document ids of packed rows, each document contiguous): nothing flows from one
    document into the next, neither through the convolution nor through the state."""
    xz = ops.einsum(f"batch seq hidden, hidden mamba_gates {INNER} -> batch seq mamba_gates {INNER}", h,
                    p["in_proj"])
    if "in_bias" in p:
        xz = xz + p["in_bias"]
    x, z = ops.unbind(xz, "mamba_gates")
    x = ops.silu(mamba2.causal_conv(x, p["conv"], p.get("conv_bias"), segments))
    R, N = m.dt_rank, m.state
    proj = ops.einsum(f"batch seq {INNER}, {INNER} ssm_xproj -> batch seq ssm_xproj", x, p["x_proj"])
    dt = ops.slice_dim(proj, "ssm_xproj", 0, R, into="mamba_dt_rank")
    b = ops.slice_dim(proj, "ssm_xproj", R, R + N, into="ssm_state")
    c = ops.slice_dim(proj, "ssm_xproj", R + N, R + 2 * N, into="ssm_state")
    if m.dt_norms:                                  # (Jamba: RMSNorms of the time step, B and C)
        dt, b, c = (ops.rms_norm(v, p[k], eps=m.eps) for v, k in ((dt, "dt_norm"), (b, "b_norm"), (c, "c_norm")))
    dt = ops.einsum(f"batch seq mamba_dt_rank, mamba_dt_rank {INNER} -> batch seq {INNER}", dt, p["dt_proj"])
    y = selective_scan(x, dt, b, c, p["A_log"], p["D"], p["dt_bias"], segments)
    y = (y * ops.silu(z.astype(y.data.dtype))).astype(h.data.dtype)
    out = ops.einsum(f"batch seq {INNER}, {INNER} hidden -> batch seq hidden", y, p["out_proj"])
    return out + p["out_bias"] if "out_bias" in p else out


def _continues(segments: Named, start_id: Named, dtype: torch.dtype) -> Named:
    """``batch seq``: 0 where a position starts another document than the one before it (the first
    position: than ``start_id``, ``batch``, the document the block's start state belongs to), else 1."""
    S = segments.size("seq")
    same = (ops.slice_dim(segments, "seq", 0, 1) - start_id).map(lambda v: (v == 0).to(dtype))
    if S == 1:
        return same
    return ops.concat([same, (ops.slice_dim(segments, "seq", 1, S) - ops.slice_dim(segments, "seq", 0, S - 1)).map(
        lambda v: (v == 0).to(dtype))], "seq")


def _states(decay: Named, inputs: Named, start: Named | None = None) -> Named:
    """Every position's state ``h_t = decay_t h_{t-1} + inputs_t`` from ``h_{-1} = start``
    (``batch mamba_inner ssm_state``; None: zero, ``h_0 = inputs_0``), ``decay`` and ``inputs``
    ``batch seq mamba_inner ssm_state``: the chunked scan of the local blocks
    (:func:`ops.linear_scan.linear_scan`) where all are laid out alike (as the scan's einsums make
    them), else a loop over named slices."""
    rest = [d for d in inputs.dims if d != "seq"]
    if start is not None and sorted(start.dims) == sorted(rest):
        start = ops.transpose(start, *rest)
    s = inputs.dims.index("seq")
    if (decay.dims, decay.split, decay.vary, decay.partial) == (inputs.dims, inputs.split, inputs.vary,
                                                                 inputs.partial) and not inputs.partial and (
            start is None or (start.dims, start.split, start.vary, start.partial) == (
                tuple(rest), inputs.split[:s] + inputs.split[s + 1:], inputs.vary, inputs.partial)):
        return inputs.map(lambda u: linear_scan(decay.data, u, s, None if start is None else start.data))
    state, out = start, []
    for t in range(inputs.size("seq")):
        u = ops.slice_dim(inputs, "seq", t, t + 1)
        state = u if state is None else ops.slice_dim(decay, "seq", t, t + 1) * state + u
        out.append(state)
    return ops.concat(out, "seq") if len(out) > 1 else out[0]


def selective_scan(x: Named, dt: Named, b: Named, c: Named, a_log: Named, d: Named, dt_bias: Named,
                   segments: Named | None = None) -> Named:
    """The selective scan of every channel of ``x`` (``batch seq mamba_inner``): with ``dt =
    softplus(dt + dt_bias)`` and ``A = -exp(A_log)`` (``mamba_inner ssm_state``), the state
    ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t`` (``B``, ``C``: ``batch seq ssm_state``, shared by the
    channels; ``h_{-1} = 0``), the output ``y_t = h_t . C_t + D x_t``; by a chunked scan along the
    sequence (every state kept for the backward, ``batch seq mamba_inner ssm_state`` as transformers'
    reference, and the chunks' decay products),
    in float32 for 16-bit inputs (as transformers). Along the sequence by
    :func:`ops.sequence_chain.along_sequence` (the blocks of a split sequence in order, the state
    handed on), each block by :func:`scan_block`. ``segments``: the state starts from zero at each
    document (the decay into a document's first position is zero)."""
    dtype = x.data.dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x, dt, b, c = (v.astype(wide) for v in (x, dt, b, c))
    dt = (dt + dt_bias.astype(wide)).map(F.softplus)
    a = -ops.exp(a_log.astype(wide))
    decay = ops.exp(ops.einsum(f"batch seq {INNER}, {INNER} ssm_state -> batch seq {INNER} ssm_state", dt, a))
    inputs = ops.einsum(f"batch seq {INNER}, batch seq ssm_state -> batch seq {INNER} ssm_state", dt * x, b)

    def step(blocks, shared, state):
        y, final, last_id = scan_block(*blocks, state[0], state[1] if len(state) > 1 else None)
        return (y,), [final] + ([] if last_id is None else [last_id])
    state = [_zero_state(inputs)]
    if segments is not None:            # (the document before the row: an id no document has)
        split = segments.split[segments.dims.index("batch")]
        local = segments.data.shape[segments.dims.index("batch")]
        state.append(make_named(torch.full((local,), -2, dtype=segments.data.dtype, device=segments.data.device),
                                ("batch",), (split,), segments.vary))
    y = along_sequence(step, [decay, inputs, c, segments], state, seq="seq", op="mamba1 selective scan")[0]
    return y + x * d.astype(wide)


def _zero_state(inputs: Named) -> Named:
    """The zero state (``batch mamba_inner ssm_state``), laid out as ``inputs``' (``batch seq mamba_inner ssm_state``)."""
    dims = ("batch", INNER, "ssm_state")
    at = [inputs.dims.index(n) for n in dims]
    return make_named(inputs.data.new_zeros([inputs.data.shape[i] for i in at]), dims,
                      tuple(inputs.split[i] for i in at), inputs.vary)


def scan_block(decay: Named, inputs: Named, c: Named, segments: Named | None, start_state: Named,
               start_id: Named | None) -> tuple[Named, Named, Named | None]:
    """The scan of one block of the sequence (the sequence whole; ``decay`` = exp(dt A), ``inputs`` =
    dt x B, ``batch seq mamba_inner ssm_state``) from ``start_state`` (``batch mamba_inner ssm_state``,
    the state before the block; with ``segments`` it belongs to document ``start_id``, ``batch``): its
    output without the D term, the state after its last position and that position's document id."""
    S = inputs.size("seq")
    if segments is not None:
        decay = decay * _continues(segments, start_id, decay.data.dtype)
    states = _states(decay, inputs, start_state)
    y = ops.einsum(f"batch seq {INNER} ssm_state, batch seq ssm_state -> batch seq {INNER}", states, c)
    return y, ops.take(states, "seq", S - 1), None if segments is None else ops.take(segments, "seq", S - 1)
