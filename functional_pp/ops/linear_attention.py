"""Linear attention over named arrays: the causal depthwise convolution along the sequence and the
gated delta rule (Gated DeltaNet: Qwen3-Next's and Qwen3.5's "linear_attention" layers), in the
chunked training form of transformers' ``torch_chunk_gated_delta_rule``.

Heads are independent, so both ops run on each device's block of heads (tensor parallelism splits
the heads, the convolution's channels with them). Along the sequence both are recurrences: the
convolution carries its last ``kernel - 1`` inputs, the rule its state; a sequence split over devices
(context parallelism) runs as a chain of blocks, each starting from the state the block before it
ended in (ops/sequence_chain.py). ``segments`` (batch seq document ids of packed rows) keep each
document to itself: no convolution tap and no state crosses a boundary, as if each document ran
alone, across devices too."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from functional_pp.ops.decayed_scores import decayed_scores
from functional_pp.ops.sequence_chain import along_sequence
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.named import Named, make_named, pvary, require_named, settle, varying_after


def _aligned(op: str, operands: list[tuple[str, Named, tuple[str, ...]]], like: dict[str, tuple[str, ...]]):
    """``operands`` (name, value, expected dims) relaid so that each dimension is split as ``like``
    says (a dimension absent from ``like``: whole) and all vary alike; their local blocks then."""
    ready = []
    for name, x, want in operands:
        if sorted(x.dims) != sorted(want):
            raise ValueError(f"{op}: {name} has dimensions {x.dims}, expected {want}")
        ready.append((x, tuple(like.get(d, ()) for d in x.dims)))
    after = [varying_after(x, t) for x, t in ready]
    union = set().union(*after)
    blocks = []
    for (x, t), a, (_, _, want) in zip(ready, after, operands):
        if x._split != t or union - a:
            x = relayout(pvary(x, union - a), t, op)
        blocks.append(x.data.permute([x.dims.index(d) for d in want]))
    return blocks, frozenset(union)


def _segments_like(segments: Named | None, batch: str, seq: str, batch_split: tuple[str, ...],
                   seq_split: tuple[str, ...]) -> Named | None:
    """The document ids (``batch seq``) laid out as the operands' batch and sequence."""
    if segments is None:
        return None
    segments = settle(segments)
    if sorted(segments.dims) != sorted((batch, seq)):
        raise ValueError(f"segments have dimensions {segments.dims}, expected ({batch!r}, {seq!r})")
    want = {batch: batch_split, seq: seq_split}
    t = tuple(want[d] for d in segments.dims)
    if segments._split != t:
        segments = relayout(segments, t, "segments")
    return segments if segments.dims == (batch, seq) else make_named(
        segments.data.t(), (batch, seq), (batch_split, seq_split), segments.vary)


def causal_conv1d(x: Named, weight: Named, *, seq: str, kernel: str, batch: str = "batch",
                  segments: Named | None = None) -> Named:
    """The causal depthwise convolution of ``x`` along ``seq``: every channel (each entry of x's
    other dimensions but the batch's, those of ``weight`` but ``kernel``) convolved with its own
    ``kernel`` taps, the last tap on the current position (transformers' ``causal_conv1d_fn``
    without its activation: ``conv1d(padding=K - 1, groups=channels)[..., :seq]``); with ``segments``
    (``batch`` ``seq``) the taps before a document's start read zeros."""
    require_named("causal_conv1d", x=x, weight=weight)
    x, weight = settle(x), settle(weight)
    if seq not in x.dims:
        raise ValueError(f"causal_conv1d: x has dimensions {x.dims}, which lack the sequence dimension {seq!r}")
    channels = tuple(d for d in weight.dims if d != kernel)
    if kernel not in weight.dims or not set(channels) <= set(x.dims):
        raise ValueError(f"causal_conv1d: weight has dimensions {weight.dims}, expected x's channel dimensions "
                         f"(of {x.dims}) and {kernel!r}")
    lead = tuple(d for d in x.dims if d not in channels)
    if segments is not None and batch not in lead:
        raise ValueError(f"causal_conv1d: segments need x's batch dimension {batch!r} (x has {x.dims})")
    like = dict(zip(x.dims, x.split))
    (xb, wb), vary = _aligned("causal_conv1d", [("x", x, lead + channels), ("weight", weight, channels + (kernel,))],
                              like)
    dims = lead + channels
    split = tuple(like.get(d, ()) for d in dims)
    xa, wa = make_named(xb, dims, split, vary), make_named(wb, channels + (kernel,), tuple(like.get(d, ()) for d in
                                                                                         channels) + ((),), vary)
    seg = _segments_like(segments, batch, seq, like.get(batch, ()), like[seq])
    s_at, b_at, K = lead.index(seq), lead.index(batch) if segments is not None else 0, wb.shape[-1]

    def step(blocks, shared, state):
        xs, ids = blocks
        xt, w = xs.data.movedim(s_at, -1), shared[0].data              # [..., channels..., seq]; [channels..., K]
        S = xt.shape[-1]
        xp = torch.cat([state[0], xt], -1)                             # the K - 1 inputs before the block first
        w = w.reshape(*((1,) * (xt.ndim - w.ndim)), *w.shape)        # broadcast over the leading dims
        if ids is None:
            out, after = sum(xp[..., j:j + S] * w[..., j:j + 1] for j in range(K)), []
        else:                                                          # a tap of another document reads zero
            sp = torch.cat([state[1], ids.data], -1)
            shape = [1] * (xt.ndim - 1)
            shape[b_at] = sp.shape[0]

            def same(j: int) -> torch.Tensor:                          # [batch, seq] -> x's layout
                return (sp[:, j:j + S] == ids.data).to(xt.dtype).reshape(*shape, S)
            out, after = sum(xp[..., j:j + S] * w[..., j:j + 1] * same(j) for j in range(K)), [sp[:, S:]]
        return (make_named(out.movedim(-1, s_at), dims, xs.split, xs.vary),), [xp[..., S:], *after]
    local = xb.movedim(s_at, -1)
    state = [local.new_zeros(*local.shape[:-1], K - 1)]            # (before the row: zeros, of no document)
    if seg is not None:
        state.append(torch.full((seg.data.shape[0], K - 1), -1, dtype=seg.data.dtype, device=seg.data.device))
    return along_sequence(step, [xa, seg], state, seq=seq, op="causal_conv1d", shared=[wa])[0]


def gated_delta_rule(q: Named, k: Named, v: Named, g: Named, beta: Named, *, batch: str, seq: str, heads: str,
                     kv_heads: str, head_dim: str, v_head_dim: str, chunk: int = 64,
                     l2_normalize_qk: bool = True, segments: Named | None = None) -> Named:
    """The gated delta rule: per value head a state S (head_dim x v_head_dim) decayed by ``exp(g)``,
    corrected towards ``v`` by ``beta`` (S <- exp(g) S + k beta (v - k exp(g) S)^T), read by the
    queries scaled by head_dim^-1/2; ``q``/``k``: batch seq kv_heads head_dim (each serving
    heads / kv_heads consecutive value heads), ``v``: batch seq heads v_head_dim, ``beta``: batch
    seq heads, ``g`` (the log decay, <= 0): batch seq heads (one decay per head: Gated DeltaNet) or
    batch seq heads head_dim (one per key channel, decaying the state's rows: Kimi Delta Attention,
    exp(g) S read as diag(exp(g)) S). ``l2_normalize_qk``: q and k L2-normalised over
    head_dim first (transformers' ``use_qk_l2norm_in_kernel``). Computed in chunks of ``chunk``
    positions as transformers' ``torch_chunk_gated_delta_rule`` (16-bit inputs in float32, others
    in their own dtype); returns batch seq heads v_head_dim, laid out as ``v``. ``segments`` (batch
    seq document ids): the state starts afresh at each document's first position. A sequence split
    over a mesh axis runs as a chain of blocks (ops/sequence_chain.py), the state handed on."""
    require_named("gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"gated_delta_rule: chunk must be a positive integer, got {chunk!r}")
    q, k, v, g, beta = (settle(x) for x in (q, k, v, g, beta))
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if seq not in x.dims:
            raise ValueError(f"gated_delta_rule: {name} has dimensions {x.dims}, which lack the sequence dimension "
                             f"{seq!r}")
    for name, x, d in (("q", q, head_dim), ("k", k, head_dim), ("v", v, v_head_dim)):
        if d in x.dims and x.split[x.dims.index(d)]:
            raise ValueError(f"gated_delta_rule: {name}'s {d!r} must not be split (it is split over "
                             f"{x.split[x.dims.index(d)]})")
    vs = dict(zip(v.dims, v.split))
    H, Hk = v.size(heads), k.size(kv_heads)
    if H % Hk:
        raise ValueError(f"gated_delta_rule: {heads} ({H}) must be a multiple of {kv_heads} ({Hk})")
    if vs.get(heads):
        from functional_pp.parallel import collectives as C
        n = C.axis_size(vs[heads])
        if Hk % n:
            raise ValueError(f"gated_delta_rule: {kv_heads} ({Hk}) is not divisible by the {n} devices of "
                             f"{vs[heads]} that split {heads} ({H}); use {kv_heads} divisible by {n}")
    like = {batch: vs.get(batch, ()), seq: vs[seq], heads: vs.get(heads, ()), kv_heads: vs.get(heads, ())}
    qk_dims, v_dims, s_dims = (batch, seq, kv_heads, head_dim), (batch, seq, heads, v_head_dim), (batch, seq, heads)
    g_dims = s_dims + (head_dim,) if head_dim in g.dims else s_dims         # (a decay per key channel: KDA)
    if head_dim in g.dims and g.split[g.dims.index(head_dim)]:
        raise ValueError(f"gated_delta_rule: g's {head_dim!r} must not be split (it is split over "
                         f"{g.split[g.dims.index(head_dim)]})")
    dims = (qk_dims, qk_dims, v_dims, g_dims, s_dims)
    blocks, vary = _aligned(
        "gated_delta_rule", [("q", q, qk_dims), ("k", k, qk_dims), ("v", v, v_dims), ("g", g, g_dims),
                             ("beta", beta, s_dims)], like)
    ready = [make_named(b, d, tuple(like.get(n, ()) for n in d), vary) for b, d in zip(blocks, dims)]
    seg = _segments_like(segments, batch, seq, like[batch], like[seq])

    def step(parts, shared, state):
        *qkvgb, ids = parts
        out, final = chunked_gated_delta_rule(*(x.data for x in qkvgb), chunk, l2_normalize_qk,
                                              None if ids is None else ids.data, *state)
        block = qkvgb[2]
        return (make_named(out, v_dims, block.split, block.vary),), [final] + ([] if ids is None else [ids.data[:, -1]])
    vb = blocks[2]
    wide = torch.float32 if vb.dtype in (torch.float16, torch.bfloat16) else vb.dtype
    state = [vb.new_zeros(vb.shape[0], vb.shape[2], blocks[0].shape[-1], vb.shape[-1], dtype=wide)]
    if seg is not None:                  # (the document before the row: an id no document has)
        state.append(torch.full((vb.shape[0],), -2, dtype=seg.data.dtype, device=seg.data.device))
    out = along_sequence(step, ready + [seg], state, seq=seq, op="gated_delta_rule")[0]
    split = out.split
    return out if out.dims == v.dims else make_named(out.data.permute([v_dims.index(d) for d in v.dims]), v.dims,
                                                     tuple(split[v_dims.index(d)] for d in v.dims), out.vary)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             chunk: int = 64, l2_normalize_qk: bool = True,
                             segments: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                             initial_id: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule of plain blocks, ``q``/``k`` [B, S, Hk, Dk], ``v`` [B, S, H, Dv],
    ``beta`` [B, S, H], ``g`` [B, S, H] or, a decay per key channel (Kimi Delta Attention, as
    transformers' ``chunk_kimi_delta_attention``), [B, S, H, Dk]; [B, S, H, Dv] in v's dtype.
    ``segments`` [B, S]: document ids; a pair of positions of different documents neither mixes
    within a chunk nor through the state (each position reads the carried state only if it continues
    the document the previous chunk ended in, and only the positions of the chunk's last document
    write the state it carries on). ``initial_state`` [B, H, Dk, Dv] (in float32 for 16-bit inputs;
    default zeros): the state before the first position, read (with ``segments``) only by positions
    of ``initial_id`` [B], the document it belongs to. Returns the output and the state after the
    last position. The scores within a chunk: ops/decayed_scores.py (per channel without a
    chunk x chunk x Dk tensor, recomputed in backward)."""
    dtype = v.dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    B, S, Hk, Dk = k.shape
    H, Dv = v.shape[-2:]
    per_channel = g.dim() == 4
    if H != Hk:
        q, k = q.repeat_interleave(H // Hk, dim=2), k.repeat_interleave(H // Hk, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(wide, memory_format=torch.contiguous_format)   # [B, H, S, ...]
                        for x in (q, k, v, beta, g))
    if l2_normalize_qk:
        q, k = _l2norm(q), _l2norm(k)
    q = q * Dk ** -0.5
    pad = (chunk - S % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, 0, 0, pad) if per_channel else (0, pad))
    n = (S + pad) // chunk
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    # the cumulative log decay within each chunk, [B, H, n, chunk] and a trailing channel dim where per channel
    decay = g.reshape(B, H, n, chunk, *g.shape[3:]).cumsum(3)
    reads = writes = carried = same = None
    if segments is not None:
        # (padding: the last document's id; its k, v and beta are zero, so it writes nothing)
        seg = torch.cat([segments, segments[:, -1:].expand(B, pad)], 1).reshape(B, 1, n, chunk)
        same = (seg.unsqueeze(-1) == seg.unsqueeze(-2)).to(wide)
        first = (torch.full_like(seg[:, :, :1, -1:], -2) if initial_id is None
                 else initial_id.reshape(B, 1, 1, 1).to(seg.dtype))
        before = torch.cat([first, seg[:, :, :-1, -1:]], 2)                   # previous chunk's end
        reads = (seg == before).to(wide)                                   # [B, 1, n, chunk]
        writes = (seg == seg[..., -1:]).to(wide)
        carried = (seg[..., -1:] == before).to(wide)                       # no document starts in the chunk
        if per_channel:
            reads, writes = reads[..., None], writes[..., None]
    # scores within each chunk, each pair of positions decayed from j to i (lower triangular with the diagonal)
    system, intra = decayed_scores([k_beta, q], k, decay)
    if same is not None:
        system, intra = system * same, intra * same
    per = (lambda t: t) if per_channel else (lambda t: t.unsqueeze(-1))    # noqa: E731  (one decay for every channel)
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    read_decay = decay.exp() if reads is None else decay.exp() * reads
    k_cum = torch.linalg.solve_triangular(system, k_beta * per(read_decay), upper=False, unitriangular=True)
    q = q * per(read_decay)
    last = decay[:, :, :, -1:]
    write_decay = (last - decay).exp()
    k = k * per(write_decay if writes is None else write_decay * writes)
    chunk_decay = last.squeeze(3).exp()                        # [B, H, n] (per channel: [B, H, n, Dk])
    if carried is not None:
        chunk_decay = chunk_decay * (carried.squeeze(-1)[..., None] if per_channel else carried.squeeze(-1))
    chunk_decay = chunk_decay[..., None] if per_channel else chunk_decay[..., None, None]
    state = torch.zeros(B, H, Dk, Dv, dtype=wide, device=v.device) if initial_state is None else initial_state.to(wide)
    outs = []
    # each operand split into its chunks once (unbind: one stack in backward; indexing chunk i would
    # allocate the whole operand's gradient per chunk, a backward quadratic in the chunks)
    for v_i, kc_i, q_i, in_i, d_i, k_i in zip(*(x.unbind(2) for x in (new_v, k_cum, q, intra, chunk_decay, k))):
        v_new = v_i - kc_i @ state
        outs.append(q_i @ state + in_i @ v_new)
        state = state * d_i + k_i.transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(B, H, n * chunk, Dv)[:, :, :S]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state
