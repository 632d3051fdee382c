"""The LM head matmul and the cross-entropy over chunks of tokens, with no full logits buffer
(docs/compile.md, "The LM head and cross-entropy over token chunks").

One pass over the tokens in forward: each chunk's logits ``x_c @ w`` (a few MiB), their
log-sum-exp, the picked logit, and, when a gradient is wanted, the chunk's gradient of the
logits ``(softmax - onehot) * row_weight`` turned at once into its share of ``dx`` (``dl_c @ w^T``)
and ``dw`` (``+= x_c^T @ dl_c``). The loss is a weighted sum over rows, so its gradient is
one scalar ``g``: backward only scales the saved ``dx`` and ``dw``. Three matrix products per
chunk, as many as the unchunked forward + backward; the logits are never stored whole.
"""
from __future__ import annotations

import torch

from functional_pp._torch import is_tracing
from functional_pp.compile.recompute import traced_as_backward


def chunk_rows(n_rows: int, n_vocab: int, chunk_bytes: int | None, chunks: int | None = None) -> int:
    """Rows per chunk: ``n_rows`` in ``chunks`` near-equal chunks when given, else so that one
    chunk of logits (fp32 counted) takes at most ``chunk_bytes`` (at least 1 row)."""
    if chunks:
        return max(1, -(-n_rows // chunks))
    return max(1, min(n_rows, chunk_bytes // max(1, 4 * n_vocab)))


def _chunk_traced(logits, idx, rw, lse, inside, need_grad):
    """A chunk's weighted loss and logits' gradient (None without ``need_grad``), as fused
    expressions for inductor (one loop over the chunk, as ops/xent/rows.py's traced backward)."""
    lse = torch.logsumexp(logits, -1) if lse is None else lse
    picked = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    loss = (rw * (lse - picked)).sum() if inside is None else -(rw * torch.where(inside, picked, 0)).sum()
    if not need_grad:
        return loss, None
    hot = torch.arange(logits.shape[-1], device=logits.device) == idx.unsqueeze(-1)
    hot = hot if inside is None else hot & inside.unsqueeze(-1)
    return loss, (torch.exp(logits - lse.unsqueeze(-1)) - hot.to(logits.dtype)) * rw.unsqueeze(-1)


def _chunk_eager(logits, idx, rw, lse, inside, need_grad):
    """:func:`_chunk_traced` eagerly: the chunk's logits buffer becomes its gradient in place,
    with no temporary of its size (``torch.logsumexp`` would allocate one)."""
    picked = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    if lse is None:
        shift = logits.amax(-1, keepdim=True)
        e = logits.sub_(shift).exp_()
        sums = e.sum(-1)
        loss = (rw * (sums.log() + shift.squeeze(-1) - picked)).sum()
        scale = rw / sums                     # softmax = e / sums
    else:
        e = logits.sub_(lse.unsqueeze(-1)).exp_()
        loss = -(rw * torch.where(inside, picked, 0)).sum()
        scale = rw
    if not need_grad:
        return loss, None
    minus = -rw if inside is None else -(rw * inside.to(rw.dtype))
    return loss, e.mul_(scale.unsqueeze(-1)).scatter_add_(-1, idx.unsqueeze(-1), minus.unsqueeze(-1))


@torch.library.custom_op("fpp::addmm_into", mutates_args=("acc",))
def addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place (one GEMM reading and writing ``acc``). An op of its own so a
    compiled step keeps it in place: inductor makes ``acc + a @ b`` an out-of-place ``addmm``
    that first copies ``acc`` into a fresh buffer (docs/compile.md, "The LM head and cross-entropy
    over token chunks")."""
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
        cdt = loss_dtype(x.dtype)
        low = x.dtype != cdt
        total = x.new_zeros((), dtype=cdt)
        dx_parts, dw, dw32 = [], None, None
        dx = None if tracing or not need_grad else torch.empty_like(x)
        for i in range(0, x.shape[0], rows):
            xc, ic, rw = x[i:i + rows], idx[i:i + rows], row_weight[i:i + rows]
            inc = None if inside is None else inside[i:i + rows]
            lc = None if lse is None else lse[i:i + rows]
            chunk = _chunk_traced if tracing else _chunk_eager
            loss, dl = chunk(torch.mm(xc, w).to(cdt), ic, rw, lc, inc, need_grad)
            total = total + loss
            if dl is None:
                continue
            dl = dl.to(x.dtype) if low else dl
            if tracing:
                dx_parts.append(torch.mm(dl, w.t()))
            else:
                torch.mm(dl, w.t(), out=dx[i:i + rows])
            if low:            # the weight's gradient summed in fp32
                part = torch.mm(xc.t(), dl).to(cdt)
                dw32 = part if dw32 is None else dw32 + part if tracing else dw32.add_(part)
            elif dw is None:
                dw = torch.mm(xc.t(), dl)
            elif tracing:
                addmm_into(dw, xc.t(), dl)
            else:
                dw.addmm_(xc.t(), dl)
        if need_grad:
            if tracing:
                dx = dx_parts[0] if len(dx_parts) == 1 else torch.cat(dx_parts)
            if low:
                dw = dw32.to(w.dtype)
            if tracing:
                ctx.save_for_backward(dx, dw)
            else:
                # eager: held by this node only, scaled in place and released by its one backward
                ctx.grads = (dx, dw)
        ctx.need_grad, ctx.traced = need_grad, tracing
        return total

    @staticmethod
    @traced_as_backward
    def backward(ctx, g):
        if not ctx.need_grad:
            raise RuntimeError("linear_cross_entropy: backward through a loss computed without gradient "
                               "(need_grad=False); compute it with gradients enabled")
        if ctx.traced:
            dx, dw = ctx.saved_tensors
            return (dx * g).to(dx.dtype), (dw * g).to(dw.dtype), None, None, None, None, None, None
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: a second backward through the same loss; its "
                               "gradients were formed in forward and handed over by the first backward. "
                               "Compute the loss again for another backward")
        dx, dw = ctx.grads
        ctx.grads = None
        return dx.mul_(g), dw.mul_(g), None, None, None, None, None, None
