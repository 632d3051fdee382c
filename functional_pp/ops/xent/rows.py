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

from functional_pp._torch import apply_function, is_tracing
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
    return apply_function(_XentRows, x, idx, lse.detach(), inside)     # (no per-call signature binding)


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


# ---------------------------------------------------------------------------- eager, row chunks
ROW_CHUNKS = 8                   # eager nll_rows_wide works on about 1/ROW_CHUNKS of the rows at a time,
MIN_CHUNK_BYTES = 8 * 2**20      # on chunks of at least this many bytes of fp32 logits (fewer launches)


def nll_rows_wide(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """:func:`nll_rows` with the whole vocabulary, eagerly, for logits ``x`` in 16 or 32 bits
    (rows contiguous, vocabulary last), each row's ``lse - x[idx]`` in fp32 (in ``x``'s dtype
    when wider), computed about ``1/ROW_CHUNKS`` of the rows at a time.

    The same numbers as casting ``x`` to fp32 and calling :func:`nll_rows` with
    ``torch.logsumexp`` of the whole cast, bitwise (each row's reductions and each element's
    arithmetic are the same ops; docs/memory.md "The loss in row chunks"), without their
    full-size buffers: the fp32 copy of 16-bit logits kept for backward, ``logsumexp``'s
    temporary and the fp32 gradient before its cast. Forward keeps ``x`` itself and the rows'
    ``lse``; backward writes the gradient in ``x``'s dtype."""
    return apply_function(_WideRows, x, idx)[0]     # (no per-call signature binding)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _row_chunks(rows: int, vocab: int) -> list[tuple[int, int]]:
    """Row ranges of about ``rows / ROW_CHUNKS`` each, of at least ``MIN_CHUNK_BYTES`` of fp32
    logits, none of a single row unless ``rows`` is 1 (a reduction with one output is split
    across threads, in another order)."""
    step = max(2, -(-rows // ROW_CHUNKS), -(-MIN_CHUNK_BYTES // (4 * vocab)))
    bounds = list(range(0, rows, step)) + [rows]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]                 # a last chunk of one row joins the one before
    return list(zip(bounds[:-1], bounds[1:]))


class _WideRows(torch.autograd.Function):
    @staticmethod
    def forward(x, idx):
        wide = _wide(x.dtype)
        flat = x.view(-1, x.shape[-1])
        chunks = _row_chunks(*flat.shape)
        if len(chunks) == 1:
            lse = torch.logsumexp(flat.to(wide), -1)
        else:
            lse = torch.empty(flat.shape[0], dtype=wide, device=x.device)
            for a, b in chunks:
                torch.logsumexp(flat[a:b].to(wide), -1, out=lse[a:b])
        lse = lse.view(idx.shape)
        # (a 16-bit picked logit is widened exactly by the subtraction's type promotion)
        return lse - x.gather(-1, idx.unsqueeze(-1)).squeeze(-1), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, idx = inputs
        ctx.save_for_backward(x, idx, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, g, _):
        x, idx, lse = ctx.saved_tensors
        wide, v = _wide(x.dtype), x.shape[-1]
        flat, flat_idx = x.view(-1, v), idx.reshape(-1, 1)
        flat_lse, flat_g = lse.reshape(-1, 1), g.reshape(-1, 1)
        chunks = _row_chunks(*flat.shape)
        grad = None if len(chunks) == 1 else torch.empty_like(x)
        for a, b in chunks:
            into = None if grad is None or wide != x.dtype else grad.view(-1, v)[a:b]
            if wide != x.dtype:        # the widened chunk, a buffer of its own, is the work space
                part = flat[a:b].to(wide).sub_(flat_lse[a:b]).exp_()
            else:
                part = torch.sub(flat[a:b], flat_lse[a:b], out=into).exp_()
            part.scatter_add_(-1, flat_idx[a:b], torch.full_like(flat_idx[a:b], -1, dtype=wide))
            part.mul_(flat_g[a:b])
            if grad is None:           # one chunk: the whole gradient, in x's dtype
                return part.to(x.dtype).view(x.shape), None
            if into is None:           # a chunk of fp32, rounded into the 16-bit gradient
                grad.view(-1, v)[a:b].copy_(part)
            del part                   # (before the next chunk's is made)
        return grad, None
