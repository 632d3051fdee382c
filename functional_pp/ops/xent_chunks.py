"""The LM head matmul and the cross-entropy over chunks of tokens, with no full logits buffer
(docs/compile.md, "Seventh round (2026-12-01, lmce)").

One pass over the tokens in forward: each chunk's logits ``x_c @ w`` (a few MiB), their
log-sum-exp, the picked logit, and, when a gradient is wanted, the chunk's gradient of the
logits ``(softmax - onehot) * row_weight`` turned at once into its share of ``dx`` (``dl_c @ w^T``)
and ``dw`` (``+= x_c^T @ dl_c``). The loss is a weighted sum over rows, so its gradient is
one scalar ``g``: backward only scales the saved ``dx`` and ``dw``. Three matrix products per
chunk, as many as the unchunked forward + backward; the logits are never stored whole.
"""
from __future__ import annotations

import torch

from ..recompute import traced_as_backward
from ..torch_private import is_tracing


def chunk_rows(n_rows: int, n_vocab: int, chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk of logits (fp32 counted) takes at most ``chunk_bytes`` (at least 1)."""
    return max(1, min(n_rows, chunk_bytes // max(1, 4 * n_vocab)))


@torch.library.custom_op("fpp::addmm_into", mutates_args=("acc",))
def addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place (one GEMM reading and writing ``acc``). An op of its own so a
    compiled step keeps it in place: inductor makes ``acc + a @ b`` an out-of-place ``addmm``
    that first copies ``acc`` into a fresh buffer (docs/compile.md, seventh round)."""
    acc.addmm_(a, b)


@addmm_into.register_fake
def _addmm_into_fake(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the logits are reduced in: fp32 for 16-bit inputs (as ``ops/loss.py``), else their own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def chunked_lse(x: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    """The log-sum-exp of each row of ``x @ w`` (fp32, no gradient), ``rows`` rows at a time."""
    with torch.no_grad():
        parts = [torch.logsumexp(torch.mm(x[i:i + rows], w).to(loss_dtype(x.dtype)), -1)
                 for i in range(0, x.shape[0], rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def linear_xent_sum(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, row_weight: torch.Tensor,
                    rows: int, need_grad: bool, lse: torch.Tensor | None = None,
                    inside: torch.Tensor | None = None) -> torch.Tensor:
    """``sum(row_weight * nll)`` over the rows of ``x`` ([N, H]) with logits ``x @ w`` ([H, V]).

    With the whole vocabulary here (``lse`` None) ``nll = lse - logits[idx]`` with each row's
    log-sum-exp computed chunk by chunk. With the vocabulary split, ``lse`` is the global one
    (computed beforehand) and the result is this block's share ``-logits[idx]`` where
    ``inside``; the gradient is still that of the whole rows' cross-entropy with respect to
    this block (``exp(logits - lse) - onehot``), so backward needs no collective. ``need_grad``
    False (eval, or nothing to differentiate) skips the gradient work."""
    row_weight = row_weight.detach().to(loss_dtype(x.dtype))
    return _LinearXent.apply(x, w, idx, row_weight, rows, need_grad,
                             None if lse is None else lse.detach(), inside)


class _LinearXent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, idx, row_weight, rows, need_grad, lse, inside):
        tracing = is_tracing()
        n, v = x.shape[0], w.shape[1]
        cdt = loss_dtype(x.dtype)
        total = x.new_zeros((), dtype=cdt)
        dx_parts, dw, dw32 = [], None, None
        dx = None if tracing or not need_grad else torch.empty_like(x)
        low = x.dtype != cdt
        cols = torch.arange(v, device=x.device)
        for i in range(0, n, rows):
            xc, ic, rw = x[i:i + rows], idx[i:i + rows], row_weight[i:i + rows]
            logits = torch.mm(xc, w).to(cdt)
            lc = torch.logsumexp(logits, -1) if lse is None else lse[i:i + rows]
            picked = logits.gather(-1, ic.unsqueeze(-1)).squeeze(-1)
            if inside is None:
                total = total + (rw * (lc - picked)).sum()
            else:
                total = total - (rw * torch.where(inside[i:i + rows], picked, 0)).sum()
            if not need_grad:
                continue
            if tracing:
                # one fused loop over the chunk (as ops/xent_rows.py's traced backward)
                hot = cols == ic.unsqueeze(-1)
                hot = hot if inside is None else hot & inside[i:i + rows].unsqueeze(-1)
                dl = ((torch.exp(logits - lc.unsqueeze(-1)) - hot.to(logits.dtype)) * rw.unsqueeze(-1)).to(x.dtype)
                dx_parts.append(torch.mm(dl, w.t()))
                if low:        # the weight's gradient summed in fp32
                    part = torch.mm(xc.t(), dl).to(cdt)
                    dw32 = part if dw32 is None else dw32 + part
                elif dw is None:
                    dw = torch.mm(xc.t(), dl)
                else:
                    addmm_into(dw, xc.t(), dl)
                continue
            # eager: the chunk's logits buffer becomes its gradient in place
            dl = logits.sub_(lc.unsqueeze(-1)).exp_()
            minus = (torch.full_like(rw, -1.0) if inside is None
                     else -inside[i:i + rows].to(dl.dtype))
            dl.scatter_add_(-1, ic.unsqueeze(-1), minus.unsqueeze(-1))
            dl.mul_(rw.unsqueeze(-1))
            dl = dl.to(x.dtype) if low else dl
            torch.mm(dl, w.t(), out=dx[i:i + rows])
            if low:            # accumulate the weight's gradient in fp32
                part = torch.mm(xc.t(), dl).to(cdt)
                dw32 = part if dw32 is None else dw32.add_(part)
            elif dw is None:
                dw = torch.mm(xc.t(), dl)
            else:
                dw.addmm_(xc.t(), dl)
        if need_grad:
            if tracing:
                dx = dx_parts[0] if len(dx_parts) == 1 else torch.cat(dx_parts)
            if low:
                dw = dw32.to(w.dtype)
            ctx.save_for_backward(dx, dw)
        ctx.need_grad = need_grad
        return total

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        if not ctx.need_grad:
            raise RuntimeError("linear_cross_entropy: backward through a loss computed without gradient "
                               "(need_grad=False); compute it with gradients enabled")
        dx, dw = ctx.saved_tensors
        return (dx * g).to(dx.dtype), (dw * g).to(dw.dtype), None, None, None, None, None, None
