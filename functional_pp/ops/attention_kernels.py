"""Attention kernels with log-sum-exp, LSE merging and ring (context-parallel) attention.

Layout everywhere: ``[batch, heads, seq, head_dim]``. ``k``/``v`` may have fewer heads
than ``q`` (grouped-query attention, ``heads % kv_heads == 0``; query head ``h`` uses
kv head ``h // (heads // kv_heads)``, i.e. ``repeat_interleave`` semantics).

The ``lse`` tensors are natural-log log-sum-exp of the scaled scores, shape
``[batch, heads, seq_q]``, dtype ``float64`` for ``float64`` inputs and ``float32``
otherwise. Fully masked rows have ``lse == -inf`` and output 0.

Only this module chooses the attention kernel (:func:`select_attention_kernel`):

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``).
* CUDA: ``aten._scaled_dot_product_flash_attention`` (fp16/bf16, sm80+) or
  ``aten._scaled_dot_product_efficient_attention`` (fp32/fp16/bf16) (+ backwards).
* anything else (other devices/dtypes/shapes): :func:`_math_attention_with_lse`,
  a pure-torch implementation that is also the test oracle.

Why one file of ~500 lines: it has one concern, attention on plain blocks with log-sum-exp.
The fused kernels, the math oracle, the LSE merge and the ring that merges block results all
rest on the conventions above (layout, GQA head mapping, lse dtype, ``-inf`` rows), which
tests/ops/test_attention_kernels.py checks together; the named op that chooses ring or all-gather
attention is ops/attention.py.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Collection, Sequence

import torch

from functional_pp.compile.recompute import traced_as_backward

__all__ = [
    "attention_with_lse",
    "attention_with_lse_backward",
    "merge_partials",
    "ring_attention",
    "ring_attention_comm_bytes",
    "select_attention_kernel",
]

_aten = torch.ops.aten

KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "math")

_EFFICIENT_LSE_ALIGN = 32  # mem-efficient attention pads its lse to a multiple of this


# ----------------------------------------------------------------------------- helpers


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / lse dtype for an input dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D [batch, heads, seq, head_dim]")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"heads {q.shape[1]} not a multiple of kv_heads {k.shape[1]}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError("causal=True needs a square block (seq_q == seq_k)")


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _reduce_kv_grad(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = g.shape
    if h == kv_heads:
        return g
    return g.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    try:
        return torch.cuda.get_device_capability(device)
    except Exception:  # pragma: no cover - no CUDA
        return (0, 0)


def select_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            skip: Collection[str] = ()) -> str:
    """Name of the kernel ``kernel="auto"`` uses for these inputs (one of ``KERNELS``), passing
    over the kernels in ``skip`` (those that already failed on this call)."""
    d, dv = q.shape[-1], v.shape[-1]
    if q.device.type in ("cpu", "meta"):      # meta: planning dry-runs save what flash saves
        if q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) and d == dv:
            if "cpu_flash" not in skip:
                return "cpu_flash"
        return "math"
    if q.device.type == "cuda":
        major, _ = _cuda_capability(q.device)
        if (
            q.dtype in (torch.float16, torch.bfloat16)
            and d == dv
            and d % 8 == 0
            and d <= 256
            and major >= 8
            and torch.backends.cuda.flash_sdp_enabled()
            and "cuda_flash" not in skip
        ):
            return "cuda_flash"
        if (
            q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and d % 8 == 0
            and dv % 8 == 0
            and d <= 256
            and dv <= 256
            and major >= 5
            and torch.backends.cuda.mem_efficient_sdp_enabled()
            and "cuda_efficient" not in skip
        ):
            return "cuda_efficient"
    return "math"


# ----------------------------------------------------------------------------- math fallback


def _math_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """``(q, k, v, scores)``: q/k/v in the accumulation dtype with k/v repeated to q's heads,
    and the scaled scores ``[B, H, Lq, Lk]`` with the causal mask applied (``-inf``)."""
    _check_shapes(q, k, v, causal)
    acc, h = _acc_dtype(q.dtype), q.shape[1]
    qf, kf, vf = q.to(acc), _expand_kv(k, h).to(acc), _expand_kv(v, h).to(acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return qf, kf, vf, s


def _math_probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Attention probabilities ``exp(s - lse)``; fully masked rows (``lse == -inf``) give 0."""
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - lse_safe.unsqueeze(-1))


def _math_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch attention returning ``(out, lse)``; differentiable; the test oracle."""
    _, _, vf, s = _math_scores(q, k, v, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(_math_probs(s, lse), vf)
    return out.to(q.dtype), lse


def _math_attention_with_lse_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, *, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch flash-style backward given ``out`` and ``lse`` (which may be global)."""
    qf, kf, vf, s = _math_scores(q, k, v, scale, causal)
    acc, hkv = qf.dtype, k.shape[1]
    gf = grad_out.to(acc)
    of = out.to(acc)
    p = _math_probs(s, lse.to(acc))
    dv = torch.matmul(p.transpose(-1, -2), gf)
    dp = torch.matmul(gf, vf.transpose(-1, -2))
    delta = (gf * of).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return (
        dq.to(q.dtype),
        _reduce_kv_grad(dk, hkv).to(k.dtype),
        _reduce_kv_grad(dv, hkv).to(v.dtype),
    )


# ----------------------------------------------------------------------------- fused kernels


def _fwd_kernel(
    name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run kernel ``name`` on same-head-count q/k/v; returns (out, lse[B,H,Lq])."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if name == "cpu_flash":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse
    if name == "cuda_flash":
        res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    if name == "cuda_efficient":
        res = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        # lse comes back padded to a multiple of 32 along seq_q.
        return res[0], res[1][:, :, : q.shape[2]]
    raise ValueError(f"unknown kernel {name!r}")


def _bwd_kernel(
    name: str, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel backward on same-head-count tensors; ``lse`` may come from a merged forward."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    grad_out = grad_out.to(q.dtype).contiguous()
    out = out.to(q.dtype).contiguous()
    lq, lk = q.shape[2], k.shape[2]
    if name == "cpu_flash":
        lse = lse.to(_acc_dtype(q.dtype)).contiguous()
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return dq, dk, dv
    # Dropout is 0, so the philox seed/offset are never read; pass placeholders.
    philox = torch.zeros((), dtype=torch.int64, device=q.device)
    if name == "cuda_flash":
        lse = lse.to(torch.float32).contiguous()
        # cum_seq_q/k=None -> undefined tensors -> dense (non-varlen) backward.
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, lq, lk, 0.0, causal, philox, philox, scale=scale
        )
        return dq, dk, dv
    if name == "cuda_efficient":
        lse = lse.to(torch.float32)
        padded = math.ceil(lq / _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
        if padded != lq:  # restore the layout the forward kernel produces
            lse = torch.nn.functional.pad(lse, (0, padded - lq))
        lse = lse.contiguous()
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, lse, philox, philox, 0.0, [True, True, True, False], causal,
            scale=scale,
        )
        return dq, dk, dv
    raise ValueError(f"unknown kernel {name!r}")


def _run_with_fallback(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fused: Callable[[str], tuple],
    math_fn: Callable[[], tuple]
) -> tuple:
    """Run ``fused(name)`` for the chosen kernel; under ``auto`` fall back on CUDA kernel errors."""
    if kernel == "math":
        return math_fn()
    if kernel != "auto":
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be 'auto' or one of {KERNELS}, got {kernel!r}")
        return fused(kernel)
    failed: set[str] = set()     # this call only: no process-wide switch (docs/policy.md)
    while True:
        name = select_attention_kernel(q, k, v, skip=failed)
        if name == "math":
            return math_fn()
        if name == "cpu_flash":
            return fused(name)  # well tested; errors are real errors
        try:
            return fused(name)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:      # CUDA kernels (tests/ops/test_attention_fallback.py fakes one)
            failed.add(name)
            warnings.warn(f"attention kernel {name} failed ({e}); falling back to the next kernel "
                          f"for this call")


# ----------------------------------------------------------------------------- public API


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
    causal: bool = False, kernel: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention returning ``(out [B,H,Lq,Dv] in q.dtype, lse [B,H,Lq] float32/float64)``.

    ``causal`` is the lower-triangular mask of a square block. ``scale`` defaults to
    ``1/sqrt(head_dim)``. ``kernel``: ``"auto"`` or one of ``KERNELS``.
    """
    _check_shapes(q, k, v, causal)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    h = q.shape[1]

    def fused(name: str):
        out, lse = _fwd_kernel(name, q, _expand_kv(k, h), _expand_kv(v, h), scale, causal)
        return out, lse.to(_acc_dtype(q.dtype))

    def math_fn():
        return _math_attention_with_lse(q, k, v, scale=scale, causal=causal)

    return _run_with_fallback(kernel, q, k, v, fused, math_fn)


def attention_with_lse_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, *, scale: float | None = None, causal: bool = False, kernel: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` (dk/dv with kv_heads) of attention given ``out`` and ``lse``.

    ``out``/``lse`` may be the *final* (merged) output and lse of a larger attention that this
    block is part of; the result is then this block's contribution to the gradients.
    """
    _check_shapes(q, k, v, causal)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    h, hkv = q.shape[1], k.shape[1]

    def fused(name: str):
        dq, dk, dv = _bwd_kernel(name, grad_out, q, _expand_kv(k, h), _expand_kv(v, h), out, lse, scale, causal)
        return dq, _reduce_kv_grad(dk, hkv), _reduce_kv_grad(dv, hkv)

    def math_fn():
        return _math_attention_with_lse_backward(grad_out, q, k, v, out, lse, scale=scale, causal=causal)

    return _run_with_fallback(kernel, q, k, v, fused, math_fn)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets by log-sum-exp.

    ``out_*``: ``[..., L, D]``, ``lse_*``: ``[..., L]``. Rows with ``lse == -inf`` (fully
    masked) contribute nothing; if both are ``-inf`` the result is out 0, lse ``-inf``.
    Computed in float32 (float64 if any input is float64); returns out in the promoted
    dtype of ``out_a``/``out_b`` and lse in the promoted lse dtype.
    """
    lse_dtype = torch.promote_types(lse_a.dtype, lse_b.dtype)
    out_dtype = torch.promote_types(out_a.dtype, out_b.dtype)
    acc = torch.promote_types(_acc_dtype(out_dtype), _acc_dtype(lse_dtype))
    la, lb = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    ea, eb = torch.exp(la - m), torch.exp(lb - m)
    tot = ea + eb
    lse = m + torch.log(tot)  # log(0) = -inf for rows masked in both
    tot = torch.where(tot == 0, torch.ones_like(tot), tot)
    wa, wb = (ea / tot).unsqueeze(-1), (eb / tot).unsqueeze(-1)
    oa, ob = out_a.to(acc), out_b.to(acc)
    # where() keeps garbage (e.g. NaN) in fully masked partial outputs from leaking.
    out = torch.where(wa > 0, wa * oa, torch.zeros_like(oa)) + torch.where(wb > 0, wb * ob, torch.zeros_like(ob))
    return out.to(out_dtype), lse.to(lse_dtype)


# ----------------------------------------------------------------------------- ring attention

ShiftFn = Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]


def _block_plan(
    src: int, rank: int, causal: bool, balanced: bool, seq: int
) -> list[tuple[slice, slice, bool]]:
    """(q_slice, kv_slice, causal) blocks of local q vs the k/v that originated on rank ``src``.

    Balanced causal layout: local seq = [chunk rank, chunk 2cp-1-rank] (and likewise for src).
    Chunk a of q vs chunk b of k: full if b < a, causal if a == b, skipped if b > a; grouped:
      src == rank -> whole block, causal (local order is monotone in global order)
      src <  rank -> all q vs first kv half, full
      src >  rank -> second q half vs all kv, full
    """
    full = slice(None)
    if not causal:
        return [(full, full, False)]
    if src == rank:
        return [(full, full, True)]
    if not balanced:
        return [(full, full, False)] if src < rank else []
    half = seq // 2
    if src < rank:
        return [(full, slice(0, half), False)]
    return [(slice(half, seq), full, False)]


def _shift(shift: ShiftFn, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    got = list(shift([t.contiguous() for t in tensors]))
    if len(got) != len(tensors):
        raise RuntimeError(f"shift returned {len(got)} tensors, expected {len(tensors)}")
    for a, b in zip(tensors, got):
        if a.shape != b.shape:
            raise RuntimeError(f"shift returned shape {tuple(b.shape)}, expected {tuple(a.shape)}")
    return got


def _ring_forward(q, k, v, scale, causal, cp_size, cp_rank, balanced, shift, kernel):
    seq = q.shape[2]
    acc = _acc_dtype(q.dtype)
    out_acc = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=acc, device=q.device)
    lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    k_cur, v_cur = k, v
    for step in range(cp_size):
        src = (cp_rank - step) % cp_size
        for qs, ks, blk_causal in _block_plan(src, cp_rank, causal, balanced, seq):
            o, l = attention_with_lse(
                q[:, :, qs], k_cur[:, :, ks], v_cur[:, :, ks], scale=scale, causal=blk_causal, kernel=kernel
            )
            out_acc[:, :, qs], lse_acc[:, :, qs] = merge_partials(
                out_acc[:, :, qs], lse_acc[:, :, qs], o.to(acc), l.to(acc)
            )
        if step < cp_size - 1:
            k_cur, v_cur = _shift(shift, [k_cur, v_cur])
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(grad_out, q, k, v, out, lse, scale, causal, cp_size, cp_rank, balanced, shift, kernel):
    seq = q.shape[2]
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_buf = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_buf = torch.zeros(v.shape, dtype=acc, device=v.device)
    k_cur, v_cur = k, v
    for step in range(cp_size):
        # k_cur/v_cur and dk_buf/dv_buf all belong to rank src here.
        src = (cp_rank - step) % cp_size
        for qs, ks, blk_causal in _block_plan(src, cp_rank, causal, balanced, seq):
            dq_b, dk_b, dv_b = attention_with_lse_backward(
                grad_out[:, :, qs], q[:, :, qs], k_cur[:, :, ks], v_cur[:, :, ks],
                out[:, :, qs], lse[:, :, qs], scale=scale, causal=blk_causal, kernel=kernel,
            )
            dq[:, :, qs] += dq_b.to(acc)
            dk_buf[:, :, ks] += dk_b.to(acc)
            dv_buf[:, :, ks] += dv_b.to(acc)
        if step < cp_size - 1:
            k_cur, v_cur, dk_buf, dv_buf = _shift(shift, [k_cur, v_cur, dk_buf, dv_buf])
    if cp_size > 1:
        # After the loop rank r holds the buffers of rank r+1; one more hop brings them home.
        dk_buf, dv_buf = _shift(shift, [dk_buf, dv_buf])
    return dq.to(q.dtype), dk_buf.to(k.dtype), dv_buf.to(v.dtype)


class SavedOutLseAttention(torch.autograd.Function):
    """The autograd shell of attention computed by a custom forward/backward pair that keeps
    ``(out, lse)``: ``forward_fn(q, k, v, *args) -> (out, lse)`` runs without grad, and
    ``backward_fn(grad_out, q, k, v, out, lse, *args) -> (dq, dk, dv)`` once, differentiable no
    further. Used by the per-device ring below and the batched simulation's ring
    (``ops/attention_ring.py``)."""
    @staticmethod
    def forward(ctx, q, k, v, forward_fn, backward_fn, *args):
        with torch.no_grad():
            out, lse = forward_fn(q.detach(), k.detach(), v.detach(), *args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward_fn, ctx.args = backward_fn, args
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @traced_as_backward
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backward_fn(grad_out, q, k, v, out, lse, *ctx.args)
        return (dq, dk, dv, None, None) + (None,) * len(ctx.args)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool,
    cp_size: int,
    cp_rank: int,
    balanced: bool = True,
    shift: ShiftFn,
    kernel: str = "auto",
) -> torch.Tensor:
    """Ring (context-parallel) attention over the local sequence shard; differentiable in q, k, v.

    Local layout: ``balanced`` and ``causal``: seq = [chunk cp_rank, chunk 2*cp_size-1-cp_rank]
    of the sequence cut into 2*cp_size chunks (local seq must be even); otherwise seq =
    contiguous chunk ``cp_rank`` of cp_size chunks (``balanced`` is irrelevant if not causal).
    k/v may have fewer heads than q (GQA). Returns the local output ``[B, H, S_local, Dv]``.

    ``shift(tensors) -> tensors`` must be called by every ring member in lockstep with
    same-shaped tensors and return what rank ``cp_rank-1 (mod cp_size)`` sent. Calls made:

    * forward: ``cp_size - 1`` calls ``shift([k, v])`` (input dtype, local k/v shapes).
    * backward: ``cp_size - 1`` calls ``shift([k, v, dk, dv])`` then 1 call ``shift([dk, dv])``;
      dk/dv have the local k/v shapes in the accumulation dtype (float32; float64 for float64
      inputs). So ``cp_size`` shifts of (dk, dv) in total.
    * ``cp_size == 1``: no calls at all.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} not in [0, {cp_size})")
    _check_shapes(q, k, v, causal)
    if causal and balanced and cp_size > 1 and q.shape[2] % 2:
        raise ValueError("balanced causal ring attention needs an even local sequence length")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return SavedOutLseAttention.apply(q, k, v, _ring_forward, _ring_backward, scale, bool(causal), int(cp_size), int(cp_rank), bool(balanced), shift, kernel)


def ring_attention_comm_bytes(k: torch.Tensor, v: torch.Tensor, cp_size: int) -> tuple[int, int]:
    """Bytes each rank sends in ``ring_attention`` (forward, backward) for local ``k``/``v``."""
    if cp_size <= 1:
        return 0, 0
    kv = k.numel() * k.element_size() + v.numel() * v.element_size()
    acc_size = torch.empty((), dtype=_acc_dtype(k.dtype)).element_size()
    dkv = (k.numel() + v.numel()) * acc_size
    return (cp_size - 1) * kv, (cp_size - 1) * kv + cp_size * dkv
