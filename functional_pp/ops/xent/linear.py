"""The LM head and the cross-entropy in one op, over chunks of tokens: no full logits buffer
in forward or backward (docs/compile.md "The LM head and cross-entropy over token chunks", docs/memory.md).

The layouts are those of ``cross_entropy(einsum(head pattern, hidden, weight), labels)``: the
einsum's plan gives the operands' layouts (an FSDP-sharded weight gathered, the hidden states
cast to varying over the axes splitting the vocabulary) and the logits' layout; with the
vocabulary split the rows' log-sum-exp is completed over the devices as in ``ops/loss.py``.
A layout whose logits would be a pending sum (the contracted dimension split in both operands)
takes that unchunked path instead."""
from __future__ import annotations

import torch

from functional_pp.ops import reduce as R
from functional_pp.ops.einsum import _plan, einsum
from functional_pp.ops.loss import IGNORE_INDEX, _count, cross_entropy
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.ops.shape import the_one_dim
from functional_pp.ops.token_ids import check_ids
from functional_pp.ops.xent.chunks import chunk_rows, chunked_lse, linear_xent_sum, loss_dtype
from functional_pp.parallel import collectives as C
from functional_pp.parallel.named import NO_AXES, Named, make_named, op_env, pvary, require_named, settle

# one chunk of fp32 logits: as fast as the unchunked head on CPU for preset small (512 rows of
# 8192); smaller chunks save more memory and cost speed (docs/compile.md "Measurements")
DEFAULT_CHUNK_BYTES = 16 << 20


def linear_cross_entropy(hidden: Named, weight: Named, labels: Named, *, vocab: str | None = None,
                         contract: str | None = None, ignore_index: int = IGNORE_INDEX,
                         chunk_bytes: int | None = DEFAULT_CHUNK_BYTES, chunks: int | None = None) -> Named:
    """Mean token cross-entropy of the logits ``hidden @ weight`` (``contract`` summed, the
    ``vocab`` dimension of ``weight`` the classes) against ``labels``, computed ``chunk_bytes``
    of fp32 logits at a time, or with ``chunks`` in that many chunks of this device's tokens
    (``chunk_bytes`` then unused); equal to ``cross_entropy(einsum(...), labels)`` within fp
    tolerance. ``chunk_bytes`` None or 0 without ``chunks`` computes exactly that unchunked
    form. By default ``contract`` is the one dimension ``hidden`` and ``weight`` share and
    ``vocab`` the weight's other one."""
    require_named("linear_cross_entropy", hidden=hidden, weight=weight, labels=labels)
    if contract is None:
        contract = the_one_dim("linear_cross_entropy", "contract", [d for d in hidden.dims if d in weight.dims],
                               "the dimension hidden and weight share")
    if vocab is None:
        vocab = the_one_dim("linear_cross_entropy", "vocab", [d for d in weight.dims if d != contract],
                            "the weight's dimension besides the contracted one")
    _check_dims(hidden, weight, vocab, contract)
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes < 0):
        raise ValueError(f"linear_cross_entropy: chunk_bytes must be a non-negative integer (bytes of "
                         f"fp32 logits per chunk) or None, got {chunk_bytes!r}")
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"linear_cross_entropy: chunks must be a positive integer (token chunks per "
                         f"device) or None, got {chunks!r}")
    other = tuple(d for d in hidden.dims if d != contract)
    pattern = f"{' '.join(hidden.dims)}, {' '.join(weight.dims)} -> {' '.join(other)} {vocab}"
    if not (chunk_bytes or chunks) or sorted(other) != sorted(labels.dims):
        # unchunked (and the loss' own message for mismatched labels)
        return cross_entropy(einsum(pattern, hidden, weight), labels, vocab, ignore_index)
    operands = [settle(hidden), settle(weight)]
    mesh, rules, plans = op_env()
    targets, casts, t_loc, vary, used, out_sizes, _, _ = _plan(pattern, operands, mesh, rules, plans)
    if used:        # the logits would be a pending sum: the unchunked path completes it first
        return cross_entropy(einsum(pattern, hidden, weight), labels, vocab, ignore_index)
    x, w = [relayout(pvary(o, c), t, "linear_cross_entropy") if (c or t != o.split) else o
            for o, c, t in zip(operands, casts, targets)]
    split_other, v_axes = tuple(t_loc[:-1]), t_loc[-1]
    labels = relayout(labels, tuple(split_other[other.index(d)] for d in labels.dims))
    extra = labels.vary - vary
    if extra:       # labels varying where the logits do not: the gradient is summed there
        x, w, vary = pvary(x, extra), pvary(w, extra), vary | extra
    order = [labels.dims.index(d) for d in other]
    lab = labels.data.permute(order) if order != sorted(order) else labels.data
    lab = check_ids(lab, out_sizes[-1], "cross_entropy", other, ignore_index)
    valid = lab != ignore_index
    valid_n = Named(valid.to(loss_dtype(x.data.dtype)), other, split_other, labels.vary)
    count = _count(valid_n)
    row_weight = (valid.to(count.data.dtype) / count.data).reshape(-1)

    xd = x.data.movedim(x.dims.index(contract), -1)
    xd = xd.reshape(-1, xd.shape[-1])                       # rows in ``other`` order
    wd = w.data if w.dims.index(contract) == 0 else w.data.t()
    rows = chunk_rows(xd.shape[0], wd.shape[1], chunk_bytes, chunks)
    need_grad = torch.is_grad_enabled() and (xd.requires_grad or wd.requires_grad)
    tok_axes = tuple(a for a in mesh.axis_names if any(a in s for s in split_other))
    flat = lab.reshape(-1)
    if not v_axes:
        total = linear_xent_sum(xd, wd, flat.clamp(0, wd.shape[1] - 1), row_weight, rows, need_grad)
        if not tok_axes and not vary and not labels.vary:
            return make_named(total, (), (), NO_AXES, sizes=())
        return Named(total, (), (), vary | set(tok_axes), tok_axes, sizes=())
    # the vocabulary split: the rows' log-sum-exp completed over the split, then this block's
    # share of -logits[label] (ops/loss.py, _split_nll_rows)
    lse_local = chunked_lse(xd, wd, rows).reshape(lab.shape)
    lse = R.logsumexp(Named(lse_local.unsqueeze(-1), other + (vocab,), split_other + (v_axes,), vary), vocab)
    local = flat - C.axis_index(v_axes) * wd.shape[1]
    inside = (local >= 0) & (local < wd.shape[1])
    lse_flat = lse.data.reshape(-1)
    share = linear_xent_sum(xd, wd, torch.where(inside, local, 0), row_weight, rows, need_grad,
                            lse=lse_flat, inside=inside)
    share = Named(share, (), (), vary | set(tok_axes) | set(v_axes), tok_axes + tuple(v_axes), sizes=())
    lse_sum = Named((lse_flat * row_weight).sum(), (), (), lse.vary | set(tok_axes), tok_axes, sizes=())
    return lse_sum + share


def _check_dims(hidden: Named, weight: Named, vocab: str, contract: str) -> None:
    if len(weight.dims) != 2 or vocab not in weight.dims or contract not in weight.dims:
        raise ValueError(f"linear_cross_entropy: the weight must have exactly the dimensions "
                         f"({contract!r}, {vocab!r}) (in either order), got {weight.dims}; pass "
                         f"vocab=/contract= to name them")
    if contract not in hidden.dims or vocab in hidden.dims:
        raise ValueError(f"linear_cross_entropy: the hidden states must have the contracted dimension "
                         f"{contract!r} and not {vocab!r}, got {hidden.dims}")
