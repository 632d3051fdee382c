"""EBFT's block-parallel rows (docs/preference.md "EBFT"): one row per document holding the
document and every sample of every block after it, so that one forward scores them all.

A document of ``S`` tokens with ``B`` blocks of ``n`` samples of ``gen`` tokens is the row

    doc[0 .. S-1] | doc[a_0 - 1] s_00 .. | doc[a_0 - 1] s_01 .. | ... | doc[a_B-1 - 1] s_(B-1)(n-1) .. | padding

each sample a segment of ``gen + 1`` tokens: the document's token before the block's anchor
``a_b`` (a copy, at position ``a_b - 1``), then the sample at positions ``a_b .. a_b + gen - 1``
(Axolotl's ``build_strided_position_ids``: block ``b``'s ``k``-th token at ``a_b + k``). The
attention (``ops.attention``'s ``segments`` with ``prefix``) lets the document's tokens see the
document causally and a sample's tokens the document before ``a_b - 1`` and their own segment
causally: exactly what the row ``doc[:a_b] + sample`` shows each token, so the hidden states and
logits equal those of one row per sample. The copied token carries the sample's first token's
log-probability (the position that sampled it), each sample token ``k`` the next one's; a
segment's last token none. All rows of a run have ``row_length`` tokens."""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["LAYOUT_KEYS", "row_length", "sample_starts", "block_parallel_row", "empty_row"]

#: the batch entries (``batch seq``) that lay out a block-parallel row for the model's forward
LAYOUT_KEYS = ("segments", "position_ids", "prefix")


def row_length(seq_len: int, max_blocks: int, n: int, gen: int) -> int:
    """The tokens of a block-parallel row: the document, then ``max_blocks x n`` segments of
    ``gen + 1`` tokens."""
    return seq_len + max_blocks * n * (gen + 1)


def sample_starts(seq_len: int, n_blocks: int, n: int, gen: int) -> torch.Tensor:
    """``[n_blocks, n]``: the row index of each sample's segment (its copied context token; the
    sample's token ``k`` at ``start + 1 + k``)."""
    return seq_len + torch.arange(n_blocks * n).view(n_blocks, n) * (gen + 1)


def empty_row(length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """A row of padding (one segment, no shared context): fills a batch, adds nothing."""
    return {"tokens": torch.full((length,), pad_id, dtype=torch.long),
            "segments": torch.zeros(length, dtype=torch.long),
            "position_ids": torch.arange(length, dtype=torch.long),
            "prefix": torch.zeros(length, dtype=torch.long)}


def block_parallel_row(doc: Sequence[int], anchors: Sequence[int], samples: torch.Tensor, length: int,
                       pad_id: int) -> dict[str, torch.Tensor]:
    """The row of a document (``doc`` its tokens), its blocks at ``anchors`` and their
    ``samples`` (``[B, n, gen]``), padded to ``length``: ``tokens``, ``segments`` (0 the
    document, ``1 + b n + j`` sample ``j`` of block ``b``, -1 the padding), ``position_ids``
    and ``prefix`` (the document's tokens a sample's segment sees: ``a_b - 1``; 0 elsewhere)."""
    seq_len, (n_blocks, n, gen) = len(doc), tuple(samples.shape)
    if n_blocks != len(anchors):
        raise ValueError(f"ebft: {len(anchors)} anchors for samples of {n_blocks} blocks")
    if length < row_length(seq_len, n_blocks, n, gen):
        raise ValueError(f"ebft: a row of {length} tokens cannot hold a document of {seq_len} and {n_blocks} x {n} "
                         f"samples of {gen + 1} (row_length)")
    row = empty_row(length, pad_id)
    row["tokens"][:seq_len] = torch.as_tensor(doc, dtype=torch.long)
    row["position_ids"][:seq_len] = torch.arange(seq_len)
    used = row_length(seq_len, n_blocks, n, gen)
    if n_blocks:
        a = torch.as_tensor(anchors, dtype=torch.long).view(n_blocks, 1, 1)
        ctx = row["tokens"][a - 1].expand(n_blocks, n, 1)
        row["tokens"][seq_len:used] = torch.cat([ctx, samples.to(torch.long)], -1).reshape(-1)
        row["position_ids"][seq_len:used] = (a - 1 + torch.arange(gen + 1)).expand(n_blocks, n, gen + 1).reshape(-1)
        row["segments"][seq_len:used] = (1 + torch.arange(n_blocks * n)).repeat_interleave(gen + 1)
        row["prefix"][seq_len:used] = (a - 1).expand(n_blocks, n, gen + 1).reshape(-1)
    row["segments"][used:] = -1
    row["position_ids"][used:] = 0
    return row
