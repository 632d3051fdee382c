"""A first-order linear recurrence along one dimension, ``h_t = a_t h_{t-1} + u_t``, computed in
chunks (Mamba (v1)'s selective scan, models/mamba1.py): the same states as the loop position by
position, to rounding, in about ``2 sqrt(S)`` vectorized steps instead of ``S``.

The sequence of ``S`` positions is cut into ``C`` chunks of ``L = ceil(sqrt(S))``. One loop of ``L``
steps runs every chunk at once from a zero state, giving each position's state within its chunk
and the product of the decays from its chunk's start (``P_t = a_t P_{t-1}``); the states at the
chunks' ends are the same recurrence over the ``C`` chunks (decay: a chunk's whole product, input:
its last local state), scanned by this function again; then ``h_t = local_t + P_t h_(chunk before)``.
Only products and sums of the given factors (no division, no logarithm): exact where decays are
zero (a document's first position) or underflow, and stable for decays in [0, 1]. The backward is
the same scan run backwards over the gradients (the adjoint recurrence), so autograd keeps only the
decays and the states (the loop kept every state twice); no ``L x L`` matrix anywhere."""
from __future__ import annotations

import math

import torch

__all__ = ["linear_scan", "SEQUENTIAL_BELOW"]

#: sequences shorter than this run position by position (chunks of 2 would not save steps)
SEQUENTIAL_BELOW = 4


def linear_scan(a: torch.Tensor, u: torch.Tensor, dim: int, start: torch.Tensor | None = None) -> torch.Tensor:
    """Every state ``h_t = a_t h_{t-1} + u_t`` along ``dim`` of ``a`` and ``u`` (one shape), from
    ``h_{-1} = start`` (``u``'s shape without ``dim``; None: zero), stacked along ``dim``."""
    if a.shape != u.shape:
        raise ValueError(f"linear_scan: decays {tuple(a.shape)} and inputs {tuple(u.shape)} must have one shape")
    a, u = a.movedim(dim, 0), u.movedim(dim, 0)
    if start is not None:
        return _LinearScan.apply(a, u, start).movedim(0, dim)
    return _LinearScan.apply(a, u).movedim(0, dim)


class _LinearScan(torch.autograd.Function):
    """:func:`_scan` with its backward written out: the adjoint ``g_t + a_{t+1} lam_{t+1} = lam_t``
    is the same recurrence run backwards (chunked alike), then ``d a_t = lam_t h_{t-1}``, ``d u_t =
    lam_t``, ``d start = a_0 lam_0``; only the decays and the states are kept for it."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, u: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
        h = _scan(a, u, start)
        ctx.save_for_backward(a, h, start)
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        a, h, start = ctx.saved_tensors
        later = torch.cat([a[1:], a.new_zeros((1,) + a.shape[1:])])          # a_{t+1}; none after the last
        lam = _scan(later.flip(0), g.flip(0), None).flip(0)
        grad_a = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.empty_like(lam)                                   # h_{t-1} times lam_t, in place
            grad_a[1:] = h[:-1]
            grad_a[0] = 0 if start is None else start
            grad_a.mul_(lam)
        grad_start = a[0] * lam[0] if start is not None and ctx.needs_input_grad[2] else None
        return grad_a, lam, grad_start


def _sequential(a: torch.Tensor, u: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    if start is None:
        out[0] = u[0]
    else:
        torch.addcmul(u[0], a[0], start.to(u.dtype), out=out[0])
    for t in range(1, u.shape[0]):
        torch.addcmul(u[t], a[t], out[t - 1], out=out[t])
    return out


def _scan(a: torch.Tensor, u: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear_scan` along dimension 0, outside autograd (each step written in place)."""
    S = u.shape[0]
    if S < SEQUENTIAL_BELOW:
        return _sequential(a, u, start)
    L = math.isqrt(S - 1) + 1                       # ceil(sqrt(S))
    C = -(-S // L)
    pad = C * L - S
    if pad:                                         # (after the last position: changes no state before it)
        a = torch.cat([a, a.new_ones((pad,) + a.shape[1:])])
        u = torch.cat([u, u.new_zeros((pad,) + u.shape[1:])])
    a, u = a.unflatten(0, (C, L)), u.unflatten(0, (C, L))
    local = torch.empty(u.shape, dtype=u.dtype, device=u.device)      # every chunk at once, from a zero state
    prods = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    local[:, 0], prods[:, 0] = u[:, 0], a[:, 0]
    for t in range(1, L):
        torch.addcmul(u[:, t], a[:, t], local[:, t - 1], out=local[:, t])
        torch.mul(a[:, t], prods[:, t - 1], out=prods[:, t])
    ends = _scan(prods[:, -1], local[:, -1], start)                     # the state at each chunk's end
    before = torch.empty_like(ends)
    before[1:] = ends[:-1]
    before[0] = 0 if start is None else start
    return local.addcmul_(prods, before.unsqueeze(1)).flatten(0, 1)[:S]
