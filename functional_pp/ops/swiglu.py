"""The gated MLP activation ``silu(gate) * up`` (SwiGLU) as one op whose backward recomputes
``silu(gate)`` from ``gate`` when the step is compiled (docs/compile.md, "SwiGLU recomputed in
backward")."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from functional_pp._torch import apply_function, is_tracing
from functional_pp.compile.recompute import traced_as_backward
from functional_pp.ops.elementwise import broadcast_binary
from functional_pp.parallel.named import Named


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` saving ``gate`` and ``up``. Traced (torch.compile), the forward's
    ``silu(gate)`` is not saved: the compiler fuses it into the product's loop and the backward
    computes it again from ``gate`` in its own loop, so no buffer of it is written or kept (a
    compiled step is one graph without a forward/backward partitioner to choose this).
    :func:`swiglu_tensors` applies it only when traced (eager it computes ``F.silu(gate) * up``
    itself); called eagerly, the forward has written ``silu(gate)`` anyway and the backward
    reuses it, as autograd of ``F.silu(gate) * up`` does (same ops, same values)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        act = F.silu(gate)
        if is_tracing():
            ctx.save_for_backward(gate, up)
        else:
            ctx.save_for_backward(gate, up, act)
        return act * up

    @staticmethod
    @traced_as_backward           # traced with the forward: its nodes marked as backward
    def backward(ctx, grad: torch.Tensor):
        gate, up, *kept = ctx.saved_tensors
        if torch.is_grad_enabled():      # create_graph=True: differentiable in gate, as torch's silu
            s = torch.sigmoid(gate)
            return grad * up * s * (1 + gate * (1 - s)), grad * (gate * s)
        act = kept[0] if kept else F.silu(gate)
        # d up = grad * silu(gate); d gate = silu'(gate) * (grad * up): autograd's ops for
        # F.silu(gate) * up (mul's backward, then silu's), so eager results are unchanged
        return torch.ops.aten.silu_backward(grad * up, gate), grad * act


def swiglu_tensors(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for plain tensors of one shape, differentiable in both (see
    :class:`_SwiGLU` for what the backward keeps). Eager, those two ops themselves: what the
    Function keeps and computes eagerly, without its Python forward and backward."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate has shape {tuple(gate.shape)} and up {tuple(up.shape)}; they must "
                         f"be equal (the two projections of one gated MLP)")
    if not is_tracing():
        return F.silu(gate) * up
    return apply_function(_SwiGLU, gate, up)


def swiglu(gate: Named, up: Named) -> Named:
    """``silu(gate) * up``, the gated MLP activation (Llama's SwiGLU), for two named arrays of
    the same dimensions (in any order): elementwise, so a layout sharding ``mlp`` (TP) needs no
    communication. Same values as ``ops.silu(gate) * up``; compiled steps keep no
    ``silu(gate)`` for the backward (docs/compile.md, "SwiGLU recomputed in backward")."""
    if not isinstance(gate, Named) or not isinstance(up, Named):
        raise TypeError(f"swiglu: gate and up must be named arrays, got {type(gate).__name__} and "
                        f"{type(up).__name__}")
    if set(gate.dims) != set(up.dims):
        raise ValueError(f"swiglu: gate has dims {gate.dims} and up {up.dims}; a gated MLP multiplies two "
                         f"projections of the same dims (use ops.silu(gate) * up to broadcast)")
    return broadcast_binary(swiglu_tensors, gate, up, "swiglu")


def clamped_swiglu_tensors(gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float,
                           up_offset: float = 1.0) -> torch.Tensor:
    """The clamped SwiGLU ``g * sigmoid(alpha * g) * (u + up_offset)`` with ``g = min(gate, limit)``
    and ``u = clamp(up, -limit, limit)``: gpt-oss's (``up_offset=1``, transformers'
    ``GptOssExperts._apply_gate``) and DeepSeek-V4's (``alpha=1, up_offset=0``: ``silu(g) * u``,
    ``DeepseekV4Experts._apply_gate``)."""
    if gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate has shape {tuple(gate.shape)} and up {tuple(up.shape)}; they "
                         f"must be equal (the two projections of one gated MLP)")
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + up_offset)


def clamped_swiglu(gate: Named, up: Named, *, alpha: float, limit: float, up_offset: float = 1.0) -> Named:
    """:func:`clamped_swiglu_tensors` of two named arrays of the same dimensions (elementwise:
    a layout sharding ``mlp`` needs no communication)."""
    if not isinstance(gate, Named) or not isinstance(up, Named):
        raise TypeError(f"clamped_swiglu: gate and up must be named arrays, got {type(gate).__name__} and "
                        f"{type(up).__name__}")
    if set(gate.dims) != set(up.dims):
        raise ValueError(f"clamped_swiglu: gate has dims {gate.dims} and up {up.dims}; they must be the same")
    return broadcast_binary(lambda g, u: clamped_swiglu_tensors(g, u, alpha=alpha, limit=limit, up_offset=up_offset),
                            gate, up,
                            "clamped_swiglu")
