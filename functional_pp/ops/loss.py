"""Cross-entropy with the vocabulary split across devices: no full-vocabulary gather."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from functional_pp._torch import is_tracing
from functional_pp.core.runtime import per_thread

from functional_pp.ops import reduce as R
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.ops.shape import the_one_dim
from functional_pp.ops.token_ids import check_ids
from functional_pp.ops.xent.rows import nll_rows, nll_rows_wide
from functional_pp.ops.xent.torch_like import loss_parallel_rows, torch_rows
from functional_pp.parallel import collectives as C
from functional_pp.parallel.named import NO_AXES, Named, make_named, require_named, settle

IGNORE_INDEX = -100

_local = per_thread("ops.loss")


@contextmanager
def logits_widened_whole() -> Iterator[None]:
    """Inside the block the loss is computed as a traced step computes it: 16-bit logits
    widened to fp32 whole (as torchtitan's and Megatron's losses do too), each row's
    ``torch.logsumexp`` and the written-out backward (ops/xent/rows.py ``nll_rows``), not by
    row chunks through torch's fused ``log_softmax``/``softmax`` as an eager step does: what a
    dry-run of a program measured that way runs (functional_pp.plan.references), and the
    eager values a traced step's equal bitwise."""
    previous = getattr(_local, "whole", False)
    _local.whole = True
    try:
        yield
    finally:
        _local.whole = previous


@contextmanager
def logits_as_torch_cross_entropy() -> Iterator[None]:
    """Inside the block the loss runs as torchtitan's does, instead of the framework's one-pass
    rows: over the whole vocabulary torch's ``F.cross_entropy`` of the fp32-widened logits
    (its backward holds three logits-sized fp32 buffers at once, the framework's two), over a
    split vocabulary DTensor's loss parallel (four at its backward's peak; ops/xent/torch_like.py).
    What a dry-run of a program measured that way runs (functional_pp.plan.references); implies
    :func:`logits_widened_whole`. The values and gradients are the framework's."""
    previous = getattr(_local, "torch_loss", False)
    _local.torch_loss = True
    try:
        with logits_widened_whole():
            yield
    finally:
        _local.torch_loss = previous


def cross_entropy(logits: Named, labels: Named, vocab: str | None = None,
                  ignore_index: int = IGNORE_INDEX) -> Named:
    """Mean token cross-entropy over every non-ignored label, with the global token count.

    ``logits`` has the labels' dimensions plus ``vocab`` (by default the one dimension the
    labels do not have); the vocabulary may be split (the
    max and the sum of exponentials are reduced across the split). Each row's gradient is
    written out, one pass over the logits (``ops/xent/rows.py``)."""
    nll, weight, fast = _nll_rows_named("cross_entropy", logits, labels, vocab, ignore_index, shortcut=True)
    if fast is not None:
        return fast
    return R.sum(nll * weight) / _count(weight)


def token_log_probs(logits: Named, labels: Named, vocab: str | None = None,
                    ignore_index: int = IGNORE_INDEX) -> Named:
    """Each label's log-probability under ``logits`` (the labels' dimensions; 0 where the label
    is ``ignore_index``): ``-cross_entropy`` per token, the vocabulary possibly split (docs/preference.md)."""
    nll, weight, _ = _nll_rows_named("token_log_probs", logits, labels, vocab, ignore_index, shortcut=False)
    return -(nll * weight)


def _nll_rows_named(op: str, logits: Named, labels: Named, vocab: str | None, ignore_index: int,
                    shortcut: bool) -> tuple:
    """Each row's cross-entropy (ignored rows not masked) and the rows' 0/1 weights, both named
    by the labels' dimensions in the logits' order; with ``shortcut`` and nothing split or
    varying, the mean cross-entropy itself as the third value (else None)."""
    require_named(op, logits=logits, labels=labels)
    if vocab is None:
        vocab = the_one_dim(op, "vocab", [d for d in logits.dims if d not in labels.dims],
                            "the logits' dimension the labels do not have")
    logits = settle(logits)
    logits._check_dim(vocab, op)
    vi = logits.dims.index(vocab)
    v_axes = logits.split[vi]
    # the rows are reduced in fp32: 16-bit logits are widened by row chunks eagerly, inside
    # torch's fused kernels (ops/xent/rows.py nll_rows_wide), whole otherwise
    chunked = (not v_axes and not is_tracing() and not getattr(_local, "whole", False)
               and logits.data.movedim(vi, -1).is_contiguous())
    if logits.data.dtype in (torch.float16, torch.bfloat16) and not chunked:
        logits = logits.astype(torch.float32)
    other = tuple(d for d in logits.dims if d != vocab)
    if sorted(other) != sorted(labels.dims):
        raise ValueError(f"{op}: labels have dimensions {labels.dims} but the logits have "
                         f"{logits.dims} (expected the logits' dimensions without {vocab!r})")
    _check_labels(op, logits, labels, other)
    labels = relayout(labels, tuple(logits.split[logits.dims.index(d)] for d in labels.dims))
    order = [labels.dims.index(d) for d in other]
    lab = labels.data.permute(order) if order != sorted(order) else labels.data
    lab = check_ids(lab, logits.shape[vocab], "cross_entropy", other, ignore_index)   # before the split
    split_other = tuple(logits.split[logits.dims.index(d)] for d in other)
    x = logits.data.movedim(vi, -1)                         # the vocabulary last (a view)
    valid = lab != ignore_index
    if v_axes:
        nll = _split_nll_rows(logits, x, lab, vocab, other, split_other)
    else:
        # one pass over the logits in backward too (ops/xent/rows.py); an ignored row's index
        # is any index, its row masked by the weights
        lab = lab.clamp(0, x.shape[-1] - 1)
        if getattr(_local, "torch_loss", False):
            nll = torch_rows(x, lab)
        elif chunked:
            nll = nll_rows_wide(x, lab)
        else:
            nll = nll_rows(x, lab, torch.logsumexp(x.detach(), -1))
        if shortcut and not any(split_other) and not logits.vary and not labels.vary:
            # nothing split or varying: the same sums and division without named bookkeeping
            # the count as an integer (exact; the division converts it as a float count would)
            count = torch.count_nonzero(valid).clamp_min(1)
            return None, None, make_named((nll * valid).sum(dim=list(range(nll.ndim))) / count, (), (), NO_AXES,
                                          sizes=())
        nll = Named(nll, other, split_other, logits.vary)
    return nll, Named(valid.to(nll.data.dtype), other, split_other, labels.vary), None


def _check_labels(op: str, logits: Named, labels: Named, other: tuple) -> None:
    """Integer labels of the logits' sizes (torch failed deep inside with ``gather(): Expected
    dtype int64`` or ``shape '[4, 9]' is invalid``: unshifted labels, fewer rows)."""
    if labels.data.dtype.is_floating_point or labels.data.dtype == torch.bool:
        raise TypeError(f"{op}: labels must be an integer tensor (token ids, {IGNORE_INDEX} where ignored), "
                        f"got {labels.data.dtype}")
    wrong = [d for d in other if labels.shape[d] != logits.shape[d]]
    if wrong:
        sizes = ", ".join(f"{d}: labels {labels.shape[d]}, logits {logits.shape[d]}" for d in wrong)
        raise ValueError(f"{op}: the labels' sizes differ from the logits' ({sizes}); the labels need one "
                         f"entry per logit row (for next-token prediction: tokens x[:, :-1], labels x[:, 1:])")


def _split_nll_rows(logits: Named, x: torch.Tensor, lab: torch.Tensor, vocab: str, other: tuple,
                    split_other: tuple) -> Named:
    """Each row's cross-entropy (ignored rows not masked) with the vocabulary split: the
    log-sum-exp completed over the split, plus the psum of the blocks' ``-x[label]``
    (:func:`xent_rows.nll_rows`, whose backward needs no collective); ``x`` is this device's
    block of logits with the vocabulary last."""
    v_axes = logits.split[logits.dims.index(vocab)]
    with torch.no_grad():       # the log-sum-exp's gradient is in nll_rows' backward
        lse = R.logsumexp(Named(x, other + (vocab,), split_other + (v_axes,), logits.vary), vocab)
    local = lab - C.axis_index(v_axes) * x.shape[-1]
    inside = (local >= 0) & (local < x.shape[-1])
    if getattr(_local, "torch_loss", False):       # DTensor's loss parallel: -log p[label] or 0
        share = loss_parallel_rows(x, torch.where(inside, local, 0), lse.data, inside)
        return Named(share, other, split_other, logits.vary, v_axes)       # the shares' psum
    share = nll_rows(x, torch.where(inside, local, 0), lse.data, inside)     # -x[label] or 0
    return lse + Named(share, other, split_other, logits.vary, v_axes)      # the shares' psum


def _count(valid: Named) -> Named:
    """The global number of non-ignored labels (at least 1), without gradient."""
    count = R.sum(valid)
    count = settle(Named(count.data.detach(), count.dims, count.split, count.vary, count.partial))
    return count.map(lambda t: t.clamp_min(1))
