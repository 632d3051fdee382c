"""The Mamba (v1) mixer (Gu & Dao 2023), the selective state space layer of Mamba and Jamba, as a
pure function over named arrays, equal to transformers' ``MambaMixer`` / ``JambaMambaMixer``
without their CUDA kernels (the recurrent loop of ``mamba_selective_scan``).

``in_proj`` gives x and the gate z of every channel (``hidden mamba_gates mamba_inner``, HF's rows
x then z); x passes the causal depthwise convolution and SiLU; ``x_proj`` gives each position's
low-rank time step, B and C (``mamba_inner ssm_xproj``, HF's rows in that order; Jamba RMS-norms
each of the three); ``dt = softplus(dt_proj(dt_low) + dt_bias)``; per channel d and state entry n
``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = h_t . C_t + D x_t`` with ``A = -exp(A_log)``;
``out_proj(y * silu(z))``.

Channels are independent: a rule ``mamba_inner="tp"`` (``llama.default_rules``) splits them with
their convolution taps, ``A_log``, ``D`` and the time step's projection (``x_proj`` is then
row-parallel: dt, B and C are completed by a sum over ``tp``; ``out_proj`` row-parallel as
attention's). The scan runs along the sequence, position by position, so the sequence must be
whole on each device: a split one (context parallelism) is refused by name. Packed rows
(``segments``) restart the state and the convolution at each document."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models import mamba2
from functional_pp.parallel.named import Named

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


def refuse_split_sequence(h: Named, where: str = "mamba1") -> None:
    """Refuse a sequence split over devices (context parallelism): the scan runs along the whole sequence."""
    axes = h.split[h.dims.index("seq")]
    if axes:
        raise ValueError(f"{where}: the Mamba (v1) selective scan needs the whole sequence on each device, but "
                         f"'seq' is split over {axes} (context parallelism); set cp_size: 1 "
                         f"(context_parallel_size) for models with Mamba layers")


def mixer(p: dict, h: Named, m: Mamba1, segments: Named | None = None) -> Named:
    """The mixer of normed input ``h`` (``batch seq hidden``, the sequence whole): ``batch seq
    hidden``, with the out projection's pending sum where the channels are split (TP). ``segments``
    (``batch seq`` document ids of packed rows, each document contiguous): nothing flows from one
    document into the next, neither through the convolution nor through the state."""
    refuse_split_sequence(h)
    if segments is not None:
        refuse_split_sequence(segments, "mamba1 segments")
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


def _continues(segments: Named, dtype: torch.dtype) -> Named:
    """``batch seq``: 0 where a position starts another document than the one before it, else 1."""
    S = segments.size("seq")
    first = ops.slice_dim(segments, "seq", 0, 1).map(lambda v: torch.ones_like(v, dtype=dtype))
    if S == 1:
        return first
    same = (ops.slice_dim(segments, "seq", 1, S) - ops.slice_dim(segments, "seq", 0, S - 1)).map(
        lambda v: (v == 0).to(dtype))
    return ops.concat([first, same], "seq")


def _states(decay: Named, inputs: Named) -> Named:
    """Every position's state ``h_t = decay_t h_{t-1} + inputs_t`` (``h_0 = inputs_0``), both
    ``batch seq mamba_inner ssm_state``: a loop over the local blocks where both are laid out alike
    (as the scan's einsums make them), else over named slices."""
    if (decay.dims, decay.split, decay.vary, decay.partial) == (inputs.dims, inputs.split, inputs.vary,
                                                                 inputs.partial) and not inputs.partial:
        s, a = inputs.dims.index("seq"), decay.data

        def run(u: torch.Tensor) -> torch.Tensor:
            h, out = u.select(s, 0), [u.select(s, 0)]
            for t in range(1, u.shape[s]):
                h = a.select(s, t) * h + u.select(s, t)
                out.append(h)
            return torch.stack(out, s)
        return inputs.map(run)
    state, out = None, []
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
    channels), the output ``y_t = h_t . C_t + D x_t``; sequentially along the sequence (every state
    kept for the backward, ``batch seq mamba_inner ssm_state`` as transformers' reference), in float32
    for 16-bit inputs (as transformers). ``segments``: the state starts from zero at each document
    (the decay into a document's first position is zero)."""
    dtype = x.data.dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x, dt, b, c = (v.astype(wide) for v in (x, dt, b, c))
    dt = (dt + dt_bias.astype(wide)).map(F.softplus)
    a = -ops.exp(a_log.astype(wide))
    decay = ops.exp(ops.einsum(f"batch seq {INNER}, {INNER} ssm_state -> batch seq {INNER} ssm_state", dt, a))
    if segments is not None:
        decay = decay * _continues(segments, wide)
    inputs = ops.einsum(f"batch seq {INNER}, batch seq ssm_state -> batch seq {INNER} ssm_state", dt * x, b)
    y = ops.einsum(f"batch seq {INNER} ssm_state, batch seq ssm_state -> batch seq {INNER}", _states(decay, inputs), c)
    return y + x * d.astype(wide)
