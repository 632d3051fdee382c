"""Cross-entropy with the vocabulary split across devices: no full-vocabulary gather."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import collectives as C
from ..named import _EMPTY, Named, _make, require_named, settle
from .regather import relayout
from . import reduce as R
from .token_ids import check_ids

IGNORE_INDEX = -100


def cross_entropy(logits: Named, labels: Named, vocab: str = "vocab",
                  ignore_index: int = IGNORE_INDEX) -> Named:
    """Mean token cross-entropy over every non-ignored label, with the global token count.

    ``logits`` has the labels' dimensions plus ``vocab``; the vocabulary may be split (the
    max and the sum of exponentials are reduced across the split)."""
    require_named("cross_entropy", logits=logits, labels=labels)
    logits = settle(logits)
    if logits.data.dtype in (torch.float16, torch.bfloat16):
        logits = logits.astype(torch.float32)
    logits._check_dim(vocab, "cross_entropy")
    other = tuple(d for d in logits.dims if d != vocab)
    if sorted(other) != sorted(labels.dims):
        raise ValueError(f"cross_entropy: labels have dimensions {labels.dims} but the logits have "
                         f"{logits.dims} (expected the logits' dimensions without {vocab!r})")
    vi = logits.dims.index(vocab)
    v_axes = logits.split[vi]
    labels = relayout(labels, tuple(logits.split[logits.dims.index(d)] for d in labels.dims))
    order = [labels.dims.index(d) for d in other]
    lab = labels.data.permute(order) if order != sorted(order) else labels.data
    lab = check_ids(lab, logits.shape[vocab], "cross_entropy", other, ignore_index)   # before the split
    split_other = tuple(logits.split[logits.dims.index(d)] for d in other)
    if not v_axes:                 # whole vocabulary here: torch's fused kernel
        nll = F.cross_entropy(logits.data.movedim(vi, -1).reshape(-1, logits.data.shape[vi]), lab.reshape(-1),
                              ignore_index=ignore_index, reduction="none").reshape(lab.shape)
        if not any(split_other) and not logits.vary and not labels.vary:
            # nothing split or varying: the same sums and division without named bookkeeping
            # the count as an integer (exact; the division converts it as a float count would)
            count = torch.count_nonzero(lab != ignore_index).clamp_min(1)
            return _make(nll.sum(dim=list(range(nll.ndim))) / count, (), (), _EMPTY, sizes=())
        valid = Named((lab != ignore_index).to(nll.dtype), other, split_other, labels.vary)
        return R.sum(Named(nll, other, split_other, logits.vary)) / _count(valid)
    lse = R.logsumexp(logits, vocab)                      # dims: other
    n_local = logits.data.shape[vi]
    local = lab - (C.axis_index(v_axes) * n_local if v_axes else 0)
    inside = (local >= 0) & (local < n_local)
    idx = torch.where(inside, local, torch.zeros_like(local)).unsqueeze(vi)
    picked = logits.data.gather(vi, idx).squeeze(vi) * inside.to(logits.data.dtype)
    picked = Named(picked, other, split_other, logits.vary, v_axes)
    valid = Named((lab != ignore_index).to(lse.data.dtype), other, split_other, labels.vary)
    nll = (lse - picked.astype(lse.data.dtype)) * valid
    return R.sum(nll) / _count(valid)


def _count(valid: Named) -> Named:
    """The global number of non-ignored labels (at least 1), without gradient."""
    count = R.sum(valid)
    count = settle(Named(count.data.detach(), count.dims, count.split, count.vary, count.partial))
    return count.map(lambda t: t.clamp_min(1))
