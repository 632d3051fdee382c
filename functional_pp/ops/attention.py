"""Attention over named arrays, with the sequence split across context-parallel devices.

The order of a split sequence belongs to its rule (docs/layouts.md): contiguous, or
load-balanced over its first mesh axis (``Rules(seq=balanced("cp"))``: device i holds chunks
i and 2c-1-i of 2c, evening out causal attention's work), then contiguous over the rest.
Attention, :func:`positions`, ``named()`` and every gather follow that order."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from functional_pp._torch import is_tracing
from functional_pp.core.observers import uneven_work
from functional_pp.core.order import balanced_indices
from functional_pp.devices import mesh_view
from functional_pp.ops.attention_kernels import ring_attention
from functional_pp.ops.attention_meta import sdpa_for
from functional_pp.ops.attention_ring import batched_ring_attention
from functional_pp.ops.keep_mask import check_rate, keep_mask
from functional_pp.ops.query_chunks import by_query_chunks
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.ops.rotary import TRACED_POSITIONS
from functional_pp.parallel import collectives as C
from functional_pp.parallel.raw_collectives import local_chunk
from functional_pp.parallel.named import (Named, make_named, memo_table, current_context, current_policy, env, op_env,
                                          pvary, require_named, settle, target_layout, varying_after)


def positions(dim: str, size: int | None = None, device: torch.device | str | None = None) -> Named:
    """Global positions of this device's part of sequence dimension ``dim`` (of global ``size``),
    made on ``device`` (that of the tokens: no host work and no copy per step on a GPU)."""
    if size is None:
        raise ValueError("positions: give the global sequence size")
    split = target_layout([dim], [size], name=f"positions {dim}")[0]
    balanced = env()[1].splits_balanced(dim, split)
    if is_tracing():     # a fresh value per trace: what is derived from it lives as long as the trace
        value = Named(_local_positions(size, split, balanced, device), [dim], [split])
        memo_table(value)[TRACED_POSITIONS] = True
        return value
    ctx = current_context(required=False)
    # eager: one value per device, launch and layout, so that what is derived from it (the rotary
    # tables) is computed once, not every step (docs/eager_overhead.md); kept in the device's
    # context, so a new launch (e.g. each dry run of the planner) starts afresh
    cache = _OUTSIDE_A_MESH if ctx is None else ctx.extras.setdefault("positions", {})
    key = (dim, size, split, balanced, None if device is None else torch.device(device))
    value = cache.get(key)
    if value is None:
        value = cache[key] = Named(_local_positions(size, split, balanced, device), [dim], [split])
    return value


_OUTSIDE_A_MESH: dict = {}     # positions values of code that runs outside any launch (one device)


def _local_positions(size: int, split: tuple[str, ...], balanced: bool, device=None) -> torch.Tensor:
    """This device's positions of a sequence of ``size`` split over ``split`` (load-balanced
    chunks over ``split[0]`` when ``balanced``); the block is taken by ``local_chunk``, which
    answers for every device at once in a batched simulation (docs/simulation.md)."""
    if not split:
        return torch.arange(size, device=device)
    if not balanced:
        return local_chunk(torch.arange(size, device=device), split, 0)
    first, rest = split[0], split[1:]
    n = C.axis_size(first)
    table = torch.stack([balanced_indices(size, n, j, device) for j in range(n)])
    base = local_chunk(table, (first,), 0).squeeze(0)
    return local_chunk(base, rest, 0) if rest else base


def attention(q: Named, k: Named, v: Named, *, causal: bool = True, scale: float | None = None,
              batch: str, seq: str, heads: str, kv_heads: str, head_dim: str,
              segments: Named | None = None, window: int | None = None,
              softcap: float | None = None, sinks: Named | None = None, chunk: int | None = None,
              kv_segments: Named | None = None, dropout: float = 0.0, dropout_seed: int = 0,
              alibi_max: float | None = None, groups: Named | None = None, kept_keys: Named | None = None,
              prefix: Named | None = None) -> Named:
    """Softmax attention; ``q``: batch seq heads head_dim, ``k``/``v``: batch seq kv_heads head_dim
    (grouped-query when kv_heads < heads), the five dimension names given by the model (bind
    them once, e.g. ``functools.partial(attention, batch="batch", seq="seq", ...)``). With
    ``seq`` split across ``cp``: ring attention (``configure(cp_attention="allgather")``
    all-gathers K/V instead).

    ``segments`` (batch seq, integer document ids of packed rows): a position attends only to
    positions of its own segment (block-diagonal causal mask, ``docs/data.md``); under context
    parallelism this uses the K/V all-gather path with the gathered segment ids.
    ``kv_segments`` (batch seq): the keys' own ids where the keys are not the queries' sequence
    (a key / value cache: the cached keys then the new ones; ``segments`` the queries'); a
    query sees the keys of its segment. Not with the sequence split over ``cp``.

    ``window`` (sliding-window attention, Mistral's ``sliding_window``): a query at position i
    sees keys at positions j with i - j < window (and |i - j| < window when not causal), as
    transformers' sliding-window mask. It works on one device, with ``segments`` and under
    context parallelism, where it uses the K/V all-gather path (ring attention has no window).

    ``softcap`` (Gemma 2's ``attn_logit_softcapping``): the scaled scores become
    ``softcap * tanh(scores / softcap)`` before the mask and the softmax; computed as explicit
    scores and probabilities (no fused kernel soft-caps), on every path above (under context
    parallelism the all-gather one).

    ``sinks`` (``heads``: gpt-oss's attention sinks) adds one learned logit per head to every
    query's softmax denominator, ``softmax([scores, sink])`` without the sink's column: the
    weights of the real keys sum to less than 1. Explicit scores and probabilities like
    ``softcap``, on every path (under context parallelism the all-gather one; split like the
    heads under tensor parallelism).

    ``chunk`` (Llama 4's ``attention_chunk_size``): a query at position i sees the keys of its
    own block of ``chunk`` positions only (i // chunk == j // chunk, and causal), as transformers'
    chunked causal mask; on every path like ``window`` (under context parallelism the all-gather
    one).

    ``dropout`` (transformers' ``attention_dropout`` in training): each softmax probability is
    zeroed with that rate and the others scaled by 1 / (1 - rate), the mask a counter-based hash
    of ``dropout_seed`` and the entry's global (batch, head, query position, key position)
    (:func:`functional_pp.ops.keep_mask.keep_mask`), so every layout drops what one device drops.
    Explicit probabilities like ``softcap`` (no fused kernel takes this mask), on every path
    (under context parallelism the all-gather one); 0: today's path, bit for bit.

    ``alibi_max`` (MPT's ALiBi, ``alibi_bias_max``): the scaled scores plus ``slope_h * (j - i)`` of
    query i and key j, head h's slope ``2 ** (-alibi_max * (h + 1) / n)`` over the heads' power of
    two n (odd ones first when the heads are fewer, as MPT's table); explicit scores like ``softcap``,
    on every path (under context parallelism the all-gather one), global heads and positions.

    ``groups`` (batch seq, integer ids; -1: none): a query also sees every key of its own group,
    before or after it and whatever the window (tokens of one image attending to each other:
    Gemma 4 unified's ``use_bidirectional_attention: vision``, transformers' ``blockwise_overlay``
    OR-ed onto the causal / sliding mask), still only inside its segment. On every path like
    ``segments`` (under context parallelism the ids all-gathered); not with ``kv_segments``.
    ``kept_keys`` (DeepSeek sparse attention's top-k, models/dsa.py): a boolean ``batch seq K``
    array, K any third name over the keys' positions; query i sees key j only where it is true
    (and the causal mask allows). One device's whole sequence only (not with ``segments``, a
    key / value cache or the sequence split).

    ``prefix`` (batch seq, integers; with ``segments``): a query also sees every key at a row
    index below its own ``prefix``, whatever the key's segment (the causal mask still applies):
    continuations packed after the context they share, each seeing that context and its own
    earlier tokens (EBFT's block-parallel rows, preference/ebft_layout.py); 0: its segment only.
    On every path like ``segments`` (under context parallelism the keys' global row indices),
    computed by blocks of queries (``ops/query_chunks.py``: the mask of one block at a time, each
    recomputed in backward; memory linear in the row); not with ``window``, ``chunk`` or
    ``alibi_max`` (they measure row indices, not the rows' positions), ``kv_segments`` or
    ``kept_keys``."""
    dropout = check_rate(dropout, "attention: dropout")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"attention: softcap must be a positive number (or None), got {softcap!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attention: window must be a positive integer (or None), got {window!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"attention: chunk must be a positive integer (or None), got {chunk!r}")
    for x in (q, k, v):
        if not isinstance(x, Named):
            require_named("attention", q=q, k=k, v=v)
    q, k, v = [settle(x) if x._partial else x for x in (q, k, v)]
    mesh, rules, plans = op_env()
    names = (batch, seq, heads, kv_heads, head_dim)
    if plans is None or q._sizes is None or k._sizes is None or v._sizes is None:
        plan = _attention_plan(q, k, v, names, mesh, rules)
    else:      # eager: derived once per operand types and kept with the rules' plans (docs/eager_overhead.md)
        key = ("attention", names, q._dims, q._split, q._vary, q._sizes, k._dims, k._split, k._vary,
               k._sizes, v._dims, v._split, v._vary, v._sizes)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _attention_plan(q, k, v, names, mesh, rules)
    cast_q, cast_k, cast_v, tk, tv, vary, orders, back, batch_split, seq_axes, balanced = plan
    if cast_q:
        q = pvary(q, cast_q)
    if cast_k or k._split != tk:
        k = relayout(pvary(k, cast_k), tk, "attention")
    if cast_v or v._split != tv:
        v = relayout(pvary(v, cast_v), tv, "attention")
    if sinks is not None:
        sinks = _sinks_like_heads(sinks, q, heads, vary)
    qt = q._data.permute(orders[0])
    kt = k._data.permute(orders[1])
    vt = v._data.permute(orders[2])
    scale = scale if scale is not None else 1.0 / math.sqrt(qt.shape[-1])
    if window is not None and window >= q.size(seq) and causal:
        window = None                 # every causal query sees at most seq keys: no window at all
    if chunk is not None and chunk >= q.size(seq):
        chunk = None                  # one block holds the whole sequence
    limits = (window, chunk)
    explicit = None
    if dropout or alibi_max is not None:       # (this device's global batch rows and heads)
        b_split, h_split = q.split[q.dims.index(batch)], q.split[q.dims.index(heads)]
        own_heads = _local_positions(q.size(heads), h_split, rules.splits_balanced(heads, h_split), qt.device)
        explicit = Explicit(dropout, dropout_seed,
                        _local_positions(q.size(batch), b_split, rules.splits_balanced(batch, b_split), qt.device),
                        own_heads, None if alibi_max is None else alibi_slopes(q.size(heads), alibi_max)[own_heads])
    if kv_segments is not None and (segments is None or seq_axes):
        raise ValueError("attention: kv_segments needs segments (the queries' ids) and the sequence unsplit "
                         f"(it is split over {seq_axes})" if seq_axes else
                         "attention: kv_segments needs segments (the queries' ids)")
    if prefix is not None:
        _check_prefix(segments, limits, alibi_max, kv_segments, kept_keys)
    if kept_keys is not None:
        if groups is not None:
            raise ValueError("attention: kept_keys (sparse attention's top-k) with groups (bidirectional groups of "
                             "tokens) is not supported")
        seg = None if segments is None else _segment_ids(segments, batch_split, seq_axes, batch, seq, qt.device)
        return _kept_keys_attention(q, qt, kt, vt, kept_keys, batch, seq, causal, scale, seq_axes, seg,
                                    kv_segments is not None, limits, softcap, sinks, explicit, back, vary)
    if groups is not None and kv_segments is not None:
        raise ValueError("attention: groups (bidirectional groups of tokens, e.g. an image's) with kv_segments (a "
                         "key / value cache) is not supported: sample without images")
    if segments is not None or groups is not None:
        seg = None if segments is None else _segment_ids(segments, batch_split, seq_axes, batch, seq, qt.device)
        kseg = None if kv_segments is None else _segment_ids(kv_segments, batch_split, seq_axes, batch, seq, qt.device)
        grp = None if groups is None else _segment_ids(groups, batch_split, seq_axes, batch, seq, qt.device)
        pre = None if prefix is None else _segment_ids(prefix, batch_split, seq_axes, batch, seq, qt.device)
        out = _segment_attention(qt, kt, vt, seg, seq_axes, causal, scale, q.size(seq), balanced, limits, softcap,
                                 sinks, kseg, explicit, grp, pre)
    elif seq_axes:
        out = _context_parallel(qt, kt, vt, seq_axes, causal, scale, q.size(seq), balanced, limits, softcap, sinks,
                                explicit)
    elif window is not None or chunk is not None or softcap is not None or sinks is not None or explicit is not None:
        kpos = torch.arange(kt.shape[2], device=qt.device)
        qpos = kpos[kt.shape[2] - qt.shape[2]:]       # (a cache's new queries: the last of the keys)
        out = _masked(qt, kt, vt, _visible(qpos, kpos, causal, *limits), scale, softcap, sinks,
                      _kept(explicit, qpos, kpos, qt.dtype), _biased(explicit, qpos, kpos))
    else:
        out = sdpa_for(qt)(qt, kt, vt, is_causal=causal, scale=scale,
                                             enable_gqa=bool(qt.shape[1] != kt.shape[1]))
    return make_named(out.permute(back), q._dims, q._split, vary, sizes=q._sizes)


def _check_prefix(segments, limits, alibi_max, kv_segments, kept_keys) -> None:
    """Refuse what ``prefix`` (shared context by row index) cannot be combined with, by name."""
    clash = [name for name, v in (("window", limits[0]), ("chunk", limits[1]), ("alibi_max", alibi_max),
                                  ("kv_segments", kv_segments), ("kept_keys", kept_keys)) if v is not None]
    if segments is None:
        raise ValueError("attention: prefix (each query's shared context) needs segments (the ids of the "
                         "continuations packed after it)")
    if clash:
        raise ValueError(f"attention: prefix (continuations packed after a shared context) with {', '.join(clash)} "
                         f"is not supported: those measure distances in row indices, which packed continuations "
                         f"do not keep (or need a key / value cache); score the continuations one row each")


def _kept_keys_attention(q: Named, qt, kt, vt, kept_keys: Named, batch: str, seq: str, causal: bool, scale: float,
                         seq_axes, seg, cached: bool, limits, softcap, sinks, explicit, back, vary) -> Named:
    """Attention where each query sees only the keys ``kept_keys`` marks (and the causal mask and
    its segment, ``seg`` (batch, seq) or None, allow)."""
    if seq_axes or cached:
        raise ValueError("attention: kept_keys (sparse attention's top-k) needs the whole sequence on each device "
                         f"and no key / value cache; the sequence is split over {seq_axes}" if seq_axes else
                         "attention: kept_keys (sparse attention's top-k) is not supported with a key / value cache")
    if not isinstance(kept_keys, Named) or len(kept_keys.dims) != 3 or kept_keys.dims[:2] != (batch, seq):
        raise ValueError(f"attention: kept_keys must be a named boolean array ({batch}, {seq}, keys), got "
                         f"{getattr(kept_keys, 'dims', type(kept_keys).__name__)}")
    b_split = q.split[q.dims.index(batch)]
    if kept_keys.split[0] != b_split or any(kept_keys.split[1:]):
        raise ValueError(f"attention: kept_keys must be laid out like the queries' batch ({b_split}) with its "
                         f"sequences whole, got splits {kept_keys.split}")
    keep = kept_keys.data.to(torch.bool)
    if keep.shape[1:] != (qt.shape[2], kt.shape[2]):
        raise ValueError(f"attention: kept_keys has sizes {tuple(keep.shape)}, expected (batch, {qt.shape[2]}, "
                         f"{kt.shape[2]})")
    kpos = torch.arange(kt.shape[2], device=qt.device)
    qpos = kpos[kt.shape[2] - qt.shape[2]:]
    seen = _visible(qpos, kpos, causal, *limits)
    mask = keep[:, None] if seen is None else keep[:, None] & seen
    if seg is not None:                                 # (packed rows: each query within its document)
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    out = _masked(qt, kt, vt, mask, scale, softcap, sinks, _kept(explicit, qpos, kpos, qt.dtype),
                  _biased(explicit, qpos, kpos))
    return make_named(out.permute(back), q._dims, q._split, vary, sizes=q._sizes)


def _attention_plan(q: Named, k: Named, v: Named, names: tuple[str, ...], mesh, rules) -> tuple:
    """What attention does with operands of these types (checked here): the axes q, k and v are
    cast to varying over, k's and v's target layouts, the output's varying axes, the permutations
    to (batch, heads, seq, head_dim) and back, q's batch and sequence splits and whether the
    sequence is split load-balanced."""
    batch, seq, heads, kv_heads, head_dim = names
    for name, x, want in (("q", q, (batch, seq, heads, head_dim)), ("k", k, (batch, seq, kv_heads, head_dim)),
                          ("v", v, (batch, seq, kv_heads, head_dim))):
        if sorted(x.dims) != sorted(want):
            raise ValueError(f"attention: {name} has dimensions {x.dims}, expected {want}")
    H, K = q.size(heads), k.size(kv_heads)
    if H % K:
        raise ValueError(f"attention: heads ({H}) must be a multiple of kv_heads ({K})")
    qs = dict(zip(q.dims, q.split))
    if qs[head_dim]:
        raise ValueError(f"attention: {head_dim!r} must not be split (it is split over {qs[head_dim]})")
    seq_axes = qs[seq]
    kv_target_of = {batch: qs[batch], seq: seq_axes, kv_heads: qs[heads], head_dim: ()}
    if qs[heads]:
        n = C.axis_size(qs[heads])
        if K % n:
            raise ValueError(f"attention: kv_heads ({K}) is not divisible by the {n} devices of "
                             f"{qs[heads]} that split heads ({H}); use kv_heads divisible by {n}")
    tk = tuple(kv_target_of[d] for d in k.dims)
    tv = tuple(kv_target_of[d] for d in v.dims)
    after = [set(q.vary - q.partial), varying_after(k, tk), varying_after(v, tv)]
    union = set().union(*after)
    casts = [frozenset(union - a) for a in after]
    orders = tuple([x.dims.index(d) for d in (batch, h, seq, head_dim)] for x, h in ((q, heads), (k, kv_heads), (v, kv_heads)))
    back = [(batch, heads, seq, head_dim).index(d) for d in q.dims]
    balanced = rules.splits_balanced(seq, seq_axes)
    return (*casts, tk, tv, frozenset(union).union(*q.split), orders, back, qs[batch], seq_axes, balanced)


def _sinks_like_heads(sinks: Named, q: Named, heads: str, vary) -> torch.Tensor:
    """This device's attention sinks (one per head of its block of ``heads``), in the output's
    varying type (their gradient summed over the axes the queries vary over)."""
    if not isinstance(sinks, Named):
        require_named("attention", sinks=sinks)
    sinks = settle(sinks) if sinks._partial else sinks
    if sinks.dims != (heads,) or sinks.size(heads) != q.size(heads):
        raise ValueError(f"attention: sinks must have dimensions ({heads},) of size {q.size(heads)} (one logit per "
                         f"head), got {sinks.dims} of sizes {tuple(sinks.data.shape)}")
    target = (q.split[q.dims.index(heads)],)
    sinks = relayout(pvary(sinks, set(vary) - varying_after(sinks, target)), target, "attention sinks")
    return sinks.data


class Explicit(NamedTuple):
    """What explicit scores and probabilities add: dropout of ``rate`` (0: none) hashed from ``seed``,
    this device's global batch ``rows`` and ``heads``, and their ALiBi ``slopes`` (None: none)."""
    rate: float
    seed: int
    rows: torch.Tensor
    heads: torch.Tensor
    slopes: torch.Tensor | None


def alibi_slopes(heads: int, alibi_max: float) -> torch.Tensor:
    """ALiBi's slope of every head (MPT's ``build_mpt_alibi_tensor``): ``2 ** (-alibi_max * i / n)``
    for i = 1..n, n the heads' power of two; with fewer heads the odd entries, then the even ones."""
    n = 2 ** math.ceil(math.log2(heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1, dtype=torch.float32) * (alibi_max / n))
    return slopes if n == heads else torch.cat([slopes[1::2], slopes[::2]])[:heads]


def _kept(explicit: Explicit | None, qpos: torch.Tensor, kpos: torch.Tensor, dtype) -> torch.Tensor | None:
    """The (batch, heads, q, k) factors of the attention dropout of ``explicit`` at global query / key
    positions: 0 or 1 / (1 - rate); None: no dropout."""
    if explicit is None or not explicit.rate:
        return None
    coords = [explicit.rows.reshape(-1, 1, 1, 1), explicit.heads.reshape(1, -1, 1, 1), qpos.reshape(1, 1, -1, 1),
              kpos.reshape(1, 1, 1, -1)]
    return keep_mask(explicit.seed, coords, explicit.rate).to(dtype) / (1.0 - explicit.rate)


def _biased(explicit: Explicit | None, qpos: torch.Tensor, kpos: torch.Tensor):
    """The (1, heads, q, k) ALiBi term of ``explicit``'s slopes at global positions; None: none."""
    if explicit is None or explicit.slopes is None:
        return None
    rel = (kpos.reshape(1, -1) - qpos.reshape(-1, 1)).to(explicit.slopes.device)
    return explicit.slopes.to(rel.device).reshape(1, -1, 1, 1) * rel


def _masked(q, k, v, mask, scale, softcap=None, sinks=None, kept=None, bias=None):
    """Attention of (batch, heads, seq, head_dim) blocks under a boolean ``mask`` (None: all
    keys): torch's SDPA, or with ``softcap`` explicit scores, soft-capped, then masked; with
    ``sinks`` (heads,) one more logit per head in each softmax, its column then dropped; with
    ``kept`` (attention dropout's factors, :func:`_kept`) the probabilities times them; with
    ``bias`` (ALiBi's, :func:`_biased`) added to the scaled scores."""
    if softcap is None and sinks is None and kept is None and bias is None:
        return sdpa_for(q)(q, k, v, attn_mask=mask, scale=scale, enable_gqa=bool(q.shape[1] != k.shape[1]))
    if k.shape[1] != q.shape[1]:                      # grouped-query: each kv head serves its group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype   # as transformers
    if sinks is not None:                             # the sink's column joins the softmax, then goes
        column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], -1), dim=-1, dtype=wide)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=wide).to(q.dtype)
    return torch.matmul(probs if kept is None else probs * kept, v)


def _visible(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, window: int | None,
             chunk: int | None = None) -> torch.Tensor | None:
    """The (q, k) boolean mask of keys each query sees: causal, within ``window`` and in the
    query's block of ``chunk`` positions; None: all."""
    if not causal and window is None and chunk is None:
        return None
    diff = qpos[:, None] - kpos[None, :]
    mask = diff >= 0 if causal else None
    if window is not None:
        near = diff < window if causal else diff.abs() < window
        mask = near if mask is None else mask & near
    if chunk is not None:
        same = (qpos[:, None] // chunk) == (kpos[None, :] // chunk)
        mask = same if mask is None else mask & same
    return mask


def _context_parallel(q, k, v, axes, causal, scale, seq_size, balanced, limits=(None, None), softcap=None,
                      sinks=None, explicit=None):
    if len(axes) != 1:
        raise ValueError(f"context-parallel attention needs the sequence split over one mesh axis; "
                         f"it is split over {axes}")
    n, i = C.axis_size(axes), C.axis_index(axes)
    if causal and balanced and seq_size % (2 * n):
        raise ValueError(f"causal context-parallel attention needs the sequence length ({seq_size}) "
                         f"divisible by 2 x {axes[0]} = {2 * n} (load-balanced chunks)")
    # (the ring has neither a window nor chunks nor a softcap nor sinks nor dropout)
    if (current_policy().cp_attention == "allgather" or limits != (None, None) or softcap is not None
            or sinks is not None or explicit is not None):
        kf = C.all_gather(k, axes, axis=2, tiled=True)
        vf = C.all_gather(v, axes, axis=2, tiled=True)
        qpos = _local_positions(seq_size, axes, balanced, q.device)
        kpos = torch.arange(seq_size, device=q.device)
        if balanced:
            kpos = torch.cat([balanced_indices(seq_size, n, j, q.device) for j in range(n)])
        mask = _visible(qpos, kpos, causal, *limits) if causal or limits != (None, None) else None
        return _masked(q, kf, vf, mask, scale, softcap, sinks, _kept(explicit, qpos, kpos, q.dtype),
                       _biased(explicit, qpos, kpos))
    if causal and not balanced:
        uneven_work(f"causal ring attention over a contiguous split of the sequence over {axes[0]!r}: "
                    f"device i of {n} computes i + 1/2 of the {n * n / 2:g} unmasked query-key blocks "
                    f"(device {n - 1} the most); balanced({axes[0]!r}) evens it out", {axes[0]: n - 1})
    pairs = tuple((j, (j + 1) % n) for j in range(n))

    def shift(tensors):
        return [C.raw_permute(t.contiguous(), axes, pairs) for t in tensors]
    return mesh_view.one_rank_or_every_device(
        lambda: ring_attention(q, k, v, scale=scale, causal=causal, cp_size=n, cp_rank=i, balanced=balanced,
                               shift=shift),
        lambda: batched_ring_attention(q, k, v, scale=scale, causal=causal, axes=tuple(axes), cp_size=n,
                                       balanced=balanced, shift=shift))     # every ring position at once


def _segment_ids(segments: Named, batch_split, seq_axes, batch: str, seq: str, device) -> torch.Tensor:
    """This device's segment ids (batch, seq) laid out like the queries."""
    segments = settle(segments)
    if sorted(segments.dims) != sorted((batch, seq)):
        raise ValueError(f"attention: segments / groups must have dimensions ({batch}, {seq}), got {segments.dims}")
    want = {batch: batch_split, seq: seq_axes}
    seg = relayout(segments, tuple(want[d] for d in segments.dims), "attention segments")
    data = seg.data if seg.dims == (batch, seq) else seg.data.t()
    return data.to(device)


def _segment_attention(q, k, v, seg, seq_axes, causal, scale, seq_size, balanced, limits=(None, None), softcap=None,
                       sinks=None, kseg=None, explicit=None, groups=None, prefix=None):
    """Block-diagonal (causal) attention: queries see keys of their own segment only (``kseg``
    the keys' ids, when they are not the queries'; ``seg`` None: one segment), and with ``groups``
    (batch, seq; -1 none) every key of their own group besides; with ``prefix`` (batch, seq) also
    every key at a (global) row index below the query's. Under context parallelism K/V and the
    ids are all-gathered."""
    kseg, qpos, kpos, kgroups = seg if kseg is None else kseg, None, None, groups
    if seq_axes:
        if len(seq_axes) != 1:
            raise ValueError(f"context-parallel attention needs the sequence split over one mesh "
                             f"axis; it is split over {seq_axes}")
        n, i = C.axis_size(seq_axes), C.axis_index(seq_axes)
        k = C.all_gather(k, seq_axes, axis=2, tiled=True)
        v = C.all_gather(v, seq_axes, axis=2, tiled=True)
        kseg = None if seg is None else C.raw_all_gather(seg.contiguous(), seq_axes, 1)
        kgroups = None if groups is None else C.raw_all_gather(groups.contiguous(), seq_axes, 1)
        qpos = _local_positions(seq_size, seq_axes, balanced, q.device)
        kpos = torch.arange(seq_size, device=q.device)
        if balanced:
            kpos = torch.cat([balanced_indices(seq_size, n, j, q.device) for j in range(n)])
    in_order = qpos is None           # (the keys in row order: not all-gathered from load-balanced chunks)
    if qpos is None:                  # the queries are the last of the keys (all of them, or a cache's new ones)
        kpos = torch.arange(k.shape[2], device=q.device)
        qpos = kpos[k.shape[2] - q.shape[2]:]
    if groups is not None and kgroups.shape[-1] != k.shape[2]:
        raise ValueError(f"attention: groups cover {kgroups.shape[-1]} keys, the keys are {k.shape[2]} (groups "
                         f"are the queries' and the keys' own ids: the same sequence)")

    def block(start: int, stop: int, keys: int) -> torch.Tensor:
        """Queries ``start .. stop - 1`` against the first ``keys`` keys."""
        part = slice(start, stop)
        qb, kb, vb, qp, kp = q[:, :, part], k[:, :, :keys], v[:, :, :keys], qpos[part], kpos[:keys]
        mask = _segment_mask(qp, kp, causal, limits, None if seg is None else seg[:, part],
                             None if kseg is None else kseg[:, :keys], None if groups is None else groups[:, part],
                             None if kgroups is None else kgroups[:, :keys],
                             None if prefix is None else prefix[:, part])
        if softcap is not None or sinks is not None or explicit is not None:
            return _masked(qb, kb, vb, mask, scale, softcap, sinks, _kept(explicit, qp, kp, q.dtype),
                           _biased(explicit, qp, kp))
        return sdpa_for(qb)(qb, kb, vb, attn_mask=mask, scale=scale,
                            enable_gqa=bool(q.shape[1] != k.shape[1]))
    if prefix is None:                # (one dense mask, as ever)
        return block(0, q.shape[2], k.shape[2])
    # the shared context's mask by blocks of queries: memory linear in the row, not quadratic
    return by_query_chunks(block, q.shape[2], k.shape[2], causal_keys=causal and in_order)


def _segment_mask(qpos, kpos, causal, limits, seg, kseg, groups, kgroups, prefix) -> torch.Tensor | None:
    """The (batch or 1, 1, q, k) boolean mask of :func:`_segment_attention` for queries at (global)
    row indices ``qpos`` and keys at ``kpos``, their segment / group ids and the queries' prefix."""
    mask = None
    if causal or limits != (None, None):
        mask = _visible(qpos, kpos, causal, *limits)[None, None]                # 1 1 q k
    if groups is not None:            # (transformers: OR-ed after the causal / sliding mask, before the documents)
        own = (groups[:, None, :, None] == kgroups[:, None, None, :]) & (groups >= 0)[:, None, :, None]
        mask = own if mask is None else mask | own
    if seg is not None:
        same = seg[:, None, :, None] == kseg[:, None, None, :]                  # batch 1 q k
        if prefix is not None:        # (and the shared context before the query's prefix)
            same = same | (kpos[None, None, None, :] < prefix[:, None, :, None])
        mask = same if mask is None else mask & same
    return mask
