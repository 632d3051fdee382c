"""The per-row term of a cross-entropy with its backward written out (docs/compile.md "The
cross-entropy's own backward").

``nll = lse - x[label]`` per row, with ``lse`` the log-sum-exp of the whole row (completed
over the devices when the vocabulary is split) computed without gradient. The backward of
:func:`nll_rows` is the gradient of the whole ``nll`` with respect to this device's block of
logits, ``g * (exp(x - lse) - onehot(label))``: one pass over the logits, with no collective
(the softmax of a block needs only the global ``lse``). Autograd of ``log_softmax`` + ``nll_loss``
computes the same gradient as ``g * onehot - exp(log_softmax) * sum(g * onehot)``, whose sum
over the vocabulary is a loop over tokens x vocabulary of its own in a compiled step.
"""
from __future__ import annotations

import torch

from functional_pp._torch import is_tracing
from functional_pp.compile.recompute import traced_as_backward


def nll_rows(x: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor,
             inside: torch.Tensor | None = None) -> torch.Tensor:
    """The cross-entropy of each row of logits ``x`` (vocabulary last) at label ``idx``, given
    the row's log-sum-exp ``lse`` (no gradient: the backward accounts for it).

    With the whole vocabulary here (``inside`` None): ``lse - x[idx]``. With the vocabulary
    split: this block's share, ``-x[idx]`` where the label lies in this block (``inside``),
    else 0; the caller adds ``lse`` once to the sum of the shares over the split. Either way
    the backward returns the gradient of the whole row's cross-entropy with respect to ``x``,
    ``g * (exp(x - lse) - onehot)``, so each device's gradient needs no collective."""
    return _XentRows.apply(x, idx, lse.detach(), inside)


class _XentRows(torch.autograd.Function):
    @staticmethod
    def forward(x, idx, lse, inside):
        picked = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        if inside is None:
            return lse - picked
        return torch.where(inside, -picked, 0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, idx, lse, inside = inputs
        ctx.whole = inside is None
        ctx.save_for_backward(x, idx, lse, *(() if inside is None else (inside,)))

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        x, idx, lse, *inside = ctx.saved_tensors
        if is_tracing():
            # one fused loop: read the logits, write the gradient (into the logits' buffer
            # when nothing else reads them; docs/compile.md "Buffer reuse past the update")
            hot = torch.arange(x.shape[-1], device=x.device) == idx.unsqueeze(-1)
            hot = hot if ctx.whole else hot & inside[0].unsqueeze(-1)
            grad = (torch.exp(x - lse.unsqueeze(-1)) - hot.to(x.dtype)) * g.unsqueeze(-1)
        else:
            # eager: one new buffer, each op in place (no one-hot temporary)
            grad = torch.sub(x, lse.unsqueeze(-1)).exp_()
            minus = torch.full_like(idx, -1, dtype=x.dtype) if ctx.whole else -inside[0].to(x.dtype)
            grad.scatter_add_(-1, idx.unsqueeze(-1), minus.unsqueeze(-1))
            grad.mul_(g.unsqueeze(-1))
        return grad, None, None, None
