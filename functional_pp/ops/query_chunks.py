"""Masked attention one block of queries at a time, each block recomputed in backward
(``torch.utils.checkpoint``): its boolean mask, the kernel's additive copy of it and its
scores exist for one block at once, so memory grows with the keys, not with keys x queries
(EBFT's block-parallel rows, ``ops.attention``'s ``prefix``: a dense ``L x L`` mask per row,
31 MB of booleans and 125 MB of SDPA's float mask per layer at ``sequence_len`` 1024).
Where the keys are in row order, a block's queries see no key after its last query: the block
computes against the keys up to it (causal), half the products of the dense mask."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["QUERY_CHUNK", "by_query_chunks"]

#: queries per block (a block's mask: batch x QUERY_CHUNK x keys)
QUERY_CHUNK = 512


def by_query_chunks(block: Callable[[int, int, int], torch.Tensor], n_queries: int, n_keys: int, *,
                    causal_keys: bool, chunk: int | None = None) -> torch.Tensor:
    """``block(start, stop, keys)``: the attention output (batch, heads, stop - start, head_dim)
    of queries ``start .. stop - 1`` against the first ``keys`` keys; concatenated over blocks of
    ``chunk`` queries (default :data:`QUERY_CHUNK`). ``causal_keys``: the queries are the last
    ``n_queries`` of ``n_keys`` keys in row order under a causal mask, so a block needs the keys
    up to its last query only."""
    chunk = chunk or QUERY_CHUNK
    if n_queries <= chunk:
        return block(0, n_queries, n_keys)
    first = n_keys - n_queries                  # (the queries' row index of the keys)
    outs = []
    for start in range(0, n_queries, chunk):
        stop = min(start + chunk, n_queries)
        keys = first + stop if causal_keys else n_keys
        if torch.is_grad_enabled():
            outs.append(checkpoint(block, start, stop, keys, use_reentrant=False))
        else:
            outs.append(block(start, stop, keys))
    return torch.cat(outs, 2)
