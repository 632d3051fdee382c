"""Ring attention for a batched simulation (docs/simulation.md, "Batched simulation").

Each ring member's block plan depends on its position in the ring (``cp_rank``), a Python
integer in ``attention_kernels._ring_forward``; in a batched run every device runs at once. So
the devices are grouped by their index along the ring's mesh axis (the backend's group-major
layout: index c holds every device at ring position c), and each position's blocks run as one
kernel call with those devices folded into the batch dimension: the same blocks, kernels and
merges as the per-device ring, in lockstep, with the shifts as collectives of all devices.
"""
from __future__ import annotations

import math

import torch

from functional_pp.core.runtime import current_context
from functional_pp.ops.attention_kernels import (SavedOutLseAttention, _acc_dtype, _block_plan, _check_shapes, _shift,
                                                 attention_with_lse, attention_with_lse_backward, merge_partials)


def _fold(x: torch.Tensor) -> torch.Tensor:
    """``(R, B, ...)`` -> ``(R*B, ...)``: the devices of one ring position as one batch."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _forward(q, k, v, backend, axes, scale, causal, n, balanced, shift, kernel):
    qg = backend.group_major(q, axes)                         # ring position, R, B, H, S, D
    seq, acc = qg.shape[4], _acc_dtype(q.dtype)
    out = torch.zeros(qg.shape[:5] + (v.shape[-1],), dtype=acc, device=qg.device)
    lse = torch.full(qg.shape[:5], float("-inf"), dtype=acc, device=qg.device)
    k_cur, v_cur = k, v
    for step in range(n):
        kg, vg = backend.group_major(k_cur, axes), backend.group_major(v_cur, axes)
        for c in range(n):
            for qs, ks, blk_causal in _block_plan((c - step) % n, c, causal, balanced, seq):
                o, l = attention_with_lse(_fold(qg[c][:, :, :, qs]), _fold(kg[c][:, :, :, ks]),
                                          _fold(vg[c][:, :, :, ks]), scale=scale, causal=blk_causal,
                                          kernel=kernel)
                shape = out[c][:, :, :, qs].shape
                out[c][:, :, :, qs], lse[c][:, :, :, qs] = merge_partials(
                    out[c][:, :, :, qs], lse[c][:, :, :, qs], o.to(acc).reshape(shape),
                    l.to(acc).reshape(shape[:-1]))
        if step < n - 1:
            k_cur, v_cur = _shift(shift, [k_cur, v_cur])
    return (backend.from_group_major(out.to(q.dtype), axes), backend.from_group_major(lse, axes))


def _backward(grad_out, q, k, v, out, lse, backend, axes, scale, causal, n, balanced, shift, kernel):
    gg, qg, og, lg = (backend.group_major(t, axes) for t in (grad_out, q, out, lse))
    seq, acc = qg.shape[4], _acc_dtype(q.dtype)
    dq = torch.zeros(qg.shape, dtype=acc, device=qg.device)
    dk_buf = backend.from_group_major(torch.zeros(backend.group_major(k, axes).shape, dtype=acc, device=qg.device), axes)
    dv_buf = backend.from_group_major(torch.zeros(backend.group_major(v, axes).shape, dtype=acc, device=qg.device), axes)
    k_cur, v_cur = k, v
    for step in range(n):
        kg, vg = backend.group_major(k_cur, axes), backend.group_major(v_cur, axes)
        dkg, dvg = backend.group_major(dk_buf, axes), backend.group_major(dv_buf, axes)   # views: written in place
        for c in range(n):
            for qs, ks, blk_causal in _block_plan((c - step) % n, c, causal, balanced, seq):
                dq_b, dk_b, dv_b = attention_with_lse_backward(
                    _fold(gg[c][:, :, :, qs]), _fold(qg[c][:, :, :, qs]), _fold(kg[c][:, :, :, ks]),
                    _fold(vg[c][:, :, :, ks]), _fold(og[c][:, :, :, qs]), _fold(lg[c][:, :, :, qs]),
                    scale=scale, causal=blk_causal, kernel=kernel)
                dq[c][:, :, :, qs] += dq_b.to(acc).reshape(dq[c][:, :, :, qs].shape)
                dkg[c][:, :, :, ks] += dk_b.to(acc).reshape(dkg[c][:, :, :, ks].shape)
                dvg[c][:, :, :, ks] += dv_b.to(acc).reshape(dvg[c][:, :, :, ks].shape)
        dk_buf = backend.from_group_major(dkg, axes)
        dv_buf = backend.from_group_major(dvg, axes)
        if step < n - 1:
            k_cur, v_cur, dk_buf, dv_buf = _shift(shift, [k_cur, v_cur, dk_buf, dv_buf])
    if n > 1:
        dk_buf, dv_buf = _shift(shift, [dk_buf, dv_buf])
    return (backend.from_group_major(dq.to(q.dtype), axes), dk_buf.to(k.dtype), dv_buf.to(v.dtype))


def batched_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None,
                           causal: bool, axes: tuple[str, ...], cp_size: int, balanced: bool, shift,
                           kernel: str = "auto") -> torch.Tensor:
    """``attention_kernels.ring_attention`` for every device of a batched simulation at once,
    the ring along mesh axes ``axes`` (each device's ring position is its index there)."""
    _check_shapes(q, k, v, causal)
    if causal and balanced and cp_size > 1 and q.shape[2] % 2:
        raise ValueError("balanced causal ring attention needs an even local sequence length")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return SavedOutLseAttention.apply(q, k, v, _forward, _backward, current_context().backend,
                                      tuple(axes), scale, bool(causal), int(cp_size), bool(balanced),
                                      shift, kernel)
