"""Embedding lookup with the vocabulary split across devices (masked local lookup + sum)."""
from __future__ import annotations

import torch

from functional_pp.parallel.fsdp.regather import regather_scope, relayout
from functional_pp.ops.token_ids import check_ids
from functional_pp.parallel import collectives as C
from functional_pp.parallel.named import Named, env, pvary, require_named, settle, varying_after


def embed(table: Named, ids: Named, vocab: str | None = None) -> Named:
    """Rows of ``table`` for integer ``ids``; the result has the ids' dimensions followed by the
    table's other dimension. ``vocab`` is the table dimension the ids index, by default its
    first (``torch.nn.functional.embedding``'s ``(num_embeddings, embedding_dim)``)."""
    require_named("embed", table=table, ids=ids)
    vocab = table.dims[0] if vocab is None else vocab
    table._check_dim(vocab, "embed")
    if ids.data.dtype.is_floating_point:
        raise TypeError(f"embed: ids must be an integer tensor, got {ids.data.dtype}")
    other = [d for d in table.dims if d != vocab]
    out_dims = ids.dims + tuple(other)
    sizes = {**table.shape, **ids.shape}
    mesh, rules = env()
    t_out = dict(zip(out_dims, rules.resolve(out_dims, [sizes[d] for d in out_dims], mesh, name="embed output")))
    v_axes = table.split[table.dims.index(vocab)]
    t_loc = {d: tuple(a for a in axes if a not in v_axes) for d, axes in t_out.items()}
    # keep the vocabulary split; other dims as the output wants them
    t_table = tuple(v_axes if d == vocab else t_loc[d] for d in table.dims)
    t_ids = tuple(t_loc[d] for d in ids.dims)
    table = settle(table)
    ids = relayout(ids, t_ids, "embed")
    checked = check_ids(ids.data, table.shape[vocab], "embed", ids.dims)   # before the vocabulary split
    after_t = varying_after(table, t_table)
    union = after_t | ids.vary
    table = relayout(pvary(table, union - after_t), t_table, "embed")
    n_local = table.data.shape[table.dims.index(vocab)]
    ids_data = checked
    if v_axes:
        lo = C.axis_index(v_axes) * n_local
        local = ids_data - lo
        inside = (local >= 0) & (local < n_local)
        ids_data = torch.where(inside, local, torch.zeros_like(local))
    weight = table.data if table.dims[0] == vocab else table.data.transpose(0, 1)
    with regather_scope([table]):
        rows = torch.nn.functional.embedding(ids_data, weight)
    if v_axes:
        rows = rows * inside.unsqueeze(-1).to(rows.dtype)
    return Named(rows, out_dims, tuple(t_loc[d] for d in out_dims), union, v_axes)
