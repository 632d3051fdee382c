"""Cross-entropy rows computed as torch computes them, for dry-runs of published runs that used
torch's loss (``ops.loss.logits_as_torch_cross_entropy``; plan/references.py): the same values
and gradients as the framework's one-pass rows (:mod:`.rows`), with torch's buffers.

* The whole vocabulary: ``F.cross_entropy`` of the fp32 logits, i.e. ``log_softmax`` (its
  result saved) and ``nll_loss``, whose backward holds three logits-sized fp32 buffers at once
  (the saved log-probabilities, ``nll_loss``'s zero-filled gradient, ``log_softmax``'s).
* The vocabulary split (DTensor's loss parallel, ``torch.distributed.tensor.parallel.loss``):
  forward ``x - max``, its ``exp`` and sum, then the log-probabilities ``shifted - lse`` (saved);
  backward one fused step ``(zeros with -1 at the label + exp(log-probabilities)) * g``, four
  block-sized fp32 buffers at its peak (the saved result, the zeros, the ``exp``, their sum).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy of logits ``x`` (vocabulary last) at label ``idx``, by
    ``F.cross_entropy`` (no reduction)."""
    return F.cross_entropy(x.reshape(-1, x.shape[-1]), idx.reshape(-1), reduction="none").reshape(idx.shape)


def loss_parallel_rows(x: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """This block's share of each row's cross-entropy with the vocabulary split, ``-logp[idx]``
    where the label lies in this block (``inside``), else 0, given the whole row's log-sum-exp
    ``lse`` (the caller adds nothing: ``-logp[label] = lse - x[label]``, so the shares' sum over
    the split is the row's cross-entropy). Backward as DTensor's loss parallel writes it; no
    collective."""
    return _LossParallelRows.apply(x, idx, lse.detach(), inside)


class _LossParallelRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, idx, lse, inside):
        logp = x - lse.unsqueeze(-1)                     # torch's ``shifted - shifted_logsumexp``
        ctx.save_for_backward(logp, idx, inside)
        return torch.where(inside, -logp.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0)

    @staticmethod
    def backward(ctx, g):
        logp, idx, inside = ctx.saved_tensors
        grad_input = torch.zeros_like(logp)
        grad_input.scatter_(-1, idx.unsqueeze(-1), inside.to(logp.dtype).neg().unsqueeze(-1))
        return (grad_input + torch.exp(logp)) * g.unsqueeze(-1), None, None, None
