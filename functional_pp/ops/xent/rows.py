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


# ---------------------------------------------------------------------------- eager
ROW_CHUNKS = 8                   # eager nll_rows_wide works on about 1/ROW_CHUNKS of the rows at a time,
MIN_CHUNK_BYTES = 8 * 2**20      # on chunks of at least this many bytes of fp32 logits (fewer launches)


def nll_rows_wide(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """:func:`nll_rows` with the whole vocabulary, eagerly (docs/memory.md "The loss in row
    chunks"): each row's ``-log_softmax(x)[idx]`` in fp32 (in ``x``'s dtype when wider), by
    torch's fused kernels: ``log_softmax`` forward (one pass over a row; ``torch.logsumexp``
    is five ops), ``softmax`` backward, whose result becomes the gradient in place
    (``g * (softmax(x) - onehot(idx))``). 16-bit logits are widened inside those kernels.

    Forward keeps only ``x``. Logits whose rows are contiguous and larger than two chunks are
    worked on about ``1/ROW_CHUNKS`` of the rows at a time: forward lets each chunk's fp32
    log-softmax go at once, backward writes each chunk's gradient into one buffer of ``x``'s
    dtype (16-bit: through fp32 chunks of half the size, the softmax's cast and result). The
    numbers are the same with one chunk or many, bitwise (both kernels work row by row)."""
    return apply_function(_WideRows, x, idx)       # (no per-call signature binding)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _one_chunk(x: torch.Tensor) -> bool:
    """Whether ``x`` is worked on whole: under two chunks' worth of fp32 bytes (each chunk of
    :func:`_row_chunks` holds at least ``MIN_CHUNK_BYTES``), two rows, or rows not contiguous."""
    return x.numel() * 4 < 2 * MIN_CHUNK_BYTES or x.numel() <= 2 * x.shape[-1] or not x.is_contiguous()


def _row_chunks(rows: int, vocab: int, split: int = 1) -> list[tuple[int, int]]:
    """Row ranges of about ``rows / ROW_CHUNKS`` each, of at least ``MIN_CHUNK_BYTES`` of fp32
    logits, none of a single row unless ``rows`` is 1; ``split`` times smaller both (a kernel
    that holds ``split`` fp32 buffers of its chunk: the same bytes at once)."""
    step = max(2, -(-rows // (ROW_CHUNKS * split)), -(-MIN_CHUNK_BYTES // (4 * vocab * split)))
    bounds = list(range(0, rows, step)) + [rows]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]                 # a last chunk of one row joins the one before
    return list(zip(bounds[:-1], bounds[1:]))


class _WideRows(torch.autograd.Function):
    @staticmethod
    def forward(x, idx):
        wide, col = _wide(x.dtype), idx.unsqueeze(-1)
        if _one_chunk(x):
            return torch.log_softmax(x, -1, dtype=wide).gather(-1, col).squeeze(-1).neg_()
        v = x.shape[-1]
        flat, flat_col = x.view(-1, v), col.reshape(-1, 1)
        nll = torch.empty(flat.shape[0], 1, dtype=wide, device=x.device)
        for a, b in _row_chunks(*flat.shape):        # (each chunk's log-softmax let go at once)
            torch.gather(torch.log_softmax(flat[a:b], -1, dtype=wide), -1, flat_col[a:b], out=nll[a:b])
        return nll.view(idx.shape).neg_()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, idx = ctx.saved_tensors
        wide = _wide(x.dtype)
        if _one_chunk(x):              # the whole gradient (in fp32 for 16-bit x), then in x's dtype
            grad = torch.softmax(x, -1, dtype=wide)
            col = idx.unsqueeze(-1)
            grad.scatter_add_(-1, col, torch.full_like(col, -1, dtype=wide))
            grad.mul_(g.unsqueeze(-1))
            return (grad if wide == x.dtype else grad.to(x.dtype)), None
        v = x.shape[-1]
        flat, flat_idx, flat_g = x.view(-1, v), idx.reshape(-1, 1), g.reshape(-1, 1)
        grad = torch.empty_like(x)
        into = grad.view(-1, v)
        # 16-bit: torch's softmax with dtype= casts the chunk to fp32 before its kernel (on the CPU,
        # and on CUDA but for fp16), two fp32 buffers of the chunk at once: chunks half the size
        for a, b in _row_chunks(*flat.shape, split=1 if wide == x.dtype else 2):
            # 16-bit: a chunk of fp32, the work space, rounded into the gradient
            part = (torch.softmax(flat[a:b], -1, out=into[a:b]) if wide == x.dtype
                    else torch.softmax(flat[a:b], -1, dtype=wide))
            part.scatter_add_(-1, flat_idx[a:b], torch.full_like(flat_idx[a:b], -1, dtype=wide))
            part.mul_(flat_g[a:b])
            if wide != x.dtype:
                into[a:b].copy_(part)
            del part                   # (before the next chunk's is made)
        return grad, None
