"""The scores of a chunk of linear attention whose keys decay between positions:
``scores[i, j] = sum_d left_i[d] right_j[d] exp(decay_i[d] - decay_j[d])`` for ``j <= i``, zero above,
``decay`` the cumulative log decay (non-increasing along the chunk). The gated delta rule's
intra-chunk system and read-out (ops/linear_attention.py) are two such score matrices.

One decay per head (``decay`` without a channel dimension) factors out of the sum: the scores are
``(left @ right^T) * exp(decay_i - decay_j)``, a chunk x chunk matrix. One decay per key channel
(Kimi Delta Attention) does not, and the direct form holds a chunk x chunk x channels tensor
(transformers' torch fallback does). Here the pairs are split by halving instead: a block of rows
``I`` and the block ``J`` just before it (of equal size) meet at I's first position ``r``, and
``exp(decay_i - decay_j) = exp(decay_i - decay_r) * exp(decay_r - decay_j)``: both factors are at
most 1 (the decay does not grow), so ``left_I exp(decay_I - decay_r) @ (right_J exp(decay_r - decay_J))^T``
is that block exactly, without overflow at any decay (a factor underflows only where the score
itself is below it), as one matmul. Halving the blocks again down to single positions covers every
pair below the diagonal once (the diagonal's decay is exp(0) = 1): memory of order
``chunk x channels x log2(chunk)`` per chunk instead of ``chunk^2 x channels``. It is the
sub-chunk scheme of flash-linear-attention's KDA / GLA kernels (a reference point per sub-chunk)
applied at every scale, so that no block needs the per-pair tensor.

Eagerly either form keeps only its inputs for backward (the rule keeps them anyway) and computes
the scores again there; traced (torch.compile) it is plain autograd, the compiler choosing what
to keep."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from functional_pp._torch import apply_function, is_tracing


def decayed_scores(lefts: list[torch.Tensor], right: torch.Tensor, decay: torch.Tensor) -> list[torch.Tensor]:
    """For each ``left`` [..., C, D] the scores [..., C, C] against ``right`` [..., C, D] (lower
    triangular with the diagonal), the pair (i, j) decayed by ``exp(decay_i - decay_j)``; ``decay``
    [..., C] (one per head: the direct product) or [..., C, D] (one per channel: halving, no
    [C, C, D] tensor). Eagerly only the inputs are kept for backward, which computes the scores
    again (:class:`_Recomputed`)."""
    form = _direct if decay.dim() == right.dim() - 1 else _halving
    if is_tracing():
        return form(lefts, right, decay)
    return list(apply_function(_Recomputed, form, right, decay, *lefts))


class _Recomputed(torch.autograd.Function):
    """``form(lefts, right, decay)`` keeping only its inputs: the backward computes the scores again
    (the halving's scaled operands, a few ``chunk x head_dim`` per level, or the direct form's
    ``chunk x chunk`` products live only then)."""

    @staticmethod
    def forward(ctx, form, right: torch.Tensor, decay: torch.Tensor, *lefts: torch.Tensor):
        ctx.form = form
        ctx.save_for_backward(right, decay, *lefts)
        return tuple(form(list(lefts), right, decay))

    @staticmethod
    def backward(ctx, *grads):
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            outs = ctx.form(leaves[2:], leaves[0], leaves[1])
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        if not pairs:
            return (None,) * (len(leaves) + 1)
        return (None, *torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True,
                                           create_graph=torch.is_grad_enabled()))


def _direct(lefts: list[torch.Tensor], right: torch.Tensor, decay: torch.Tensor) -> list[torch.Tensor]:
    """One decay per head factors out: ``(left @ right^T) * exp(decay_i - decay_j)``."""
    C = right.shape[-2]
    upper = torch.ones(C, C, dtype=torch.bool, device=right.device).triu(1)
    pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    return [(left @ right.transpose(-1, -2)) * pair for left in lefts]


def _halving(lefts: list[torch.Tensor], right: torch.Tensor, decay: torch.Tensor) -> list[torch.Tensor]:
    """The per-channel scores by halving (the module's docstring)."""
    C = right.shape[-2]
    P = 1 << (C - 1).bit_length()                              # halving wants a power of two: pad with
    if P != C:                                                 # zero rows and a constant decay
        lefts, right = [F.pad(x, (0, 0, 0, P - C)) for x in lefts], F.pad(right, (0, 0, 0, P - C))
        decay = torch.cat([decay, decay[..., -1:, :].expand(*decay.shape[:-2], P - C, decay.shape[-1])], -2)
    lead, D = right.shape[:-2], right.shape[-1]
    # blocks[t]: the scores within each diagonal block of the current size s, [..., P / s, s, s]
    blocks = [(left * right).sum(-1).reshape(*lead, P, 1, 1) for left in lefts]
    s = 1
    while s < P:
        m = P // (2 * s)                                       # pairs of sibling blocks (J, I)
        at = (*lead, m, 2, s, D)
        d = decay.reshape(at)
        ref = d[..., 1, :1, :]                                 # I's first position
        r = right.reshape(at)[..., 0, :, :] * (ref - d[..., 0, :, :]).exp()   # right_J exp(decay_r - decay_J)
        scale = (d[..., 1, :, :] - ref).exp()                                # exp(decay_I - decay_r)
        grown = []
        for left, b in zip(lefts, blocks):
            below = (left.reshape(at)[..., 1, :, :] * scale) @ r.transpose(-1, -2)     # rows I, columns J
            b = b.reshape(*lead, m, 2, s, s)
            top = torch.cat([b[..., 0, :, :], torch.zeros_like(below)], -1)
            grown.append(torch.cat([top, torch.cat([below, b[..., 1, :, :]], -1)], -2))
        blocks, s = grown, 2 * s
    return [b.reshape(*lead, P, P)[..., :C, :C] for b in blocks]
