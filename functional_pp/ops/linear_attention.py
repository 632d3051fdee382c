"""Linear attention over named arrays: the causal depthwise convolution along the sequence and the
gated delta rule (Gated DeltaNet: Qwen3-Next's and Qwen3.5's "linear_attention" layers), in the
chunked training form of transformers' ``torch_chunk_gated_delta_rule``.

Heads are independent, so both ops run on each device's block of heads (tensor parallelism splits
the heads, the convolution's channels with them); the sequence is a recurrence and must be whole:
an operand whose sequence dimension is split (context parallelism, or a sequence-parallel residual
not gathered first) is refused by name before any work. ``segments`` (batch seq document ids of
packed rows) keep each document to itself: no convolution tap and no state crosses a boundary, as
if each document ran alone."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.named import Named, make_named, pvary, require_named, settle, varying_after


def _whole_sequence(op: str, seq: str, **operands: Named) -> None:
    for name, x in operands.items():
        if seq not in x.dims:
            raise ValueError(f"{op}: {name} has dimensions {x.dims}, which lack the sequence dimension {seq!r}")
        axes = x.split[x.dims.index(seq)]
        if axes:
            raise ValueError(f"{op}: {name}'s sequence dimension {seq!r} is split over {axes}; this layer is a "
                             f"recurrence along the whole sequence: gather it first (as attention's input is "
                             f"gathered under sequence parallelism) or do not split {seq!r} (no context "
                             f"parallelism, cp_size 1, for models with these layers)")


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


def _segment_block(segments: Named | None, batch: str, seq: str, batch_split: tuple[str, ...]) -> torch.Tensor | None:
    """This device's [batch, seq] block of the document ids, laid out as the operands' batch."""
    if segments is None:
        return None
    segments = settle(segments)
    if sorted(segments.dims) != sorted((batch, seq)):
        raise ValueError(f"segments have dimensions {segments.dims}, expected ({batch!r}, {seq!r})")
    _whole_sequence("segments", seq, segments=segments)
    t = tuple(batch_split if d == batch else () for d in segments.dims)
    if segments._split != t:
        segments = relayout(segments, t, "segments")
    return segments.data.permute([segments.dims.index(d) for d in (batch, seq)])


def causal_conv1d(x: Named, weight: Named, *, seq: str, kernel: str, batch: str = "batch",
                  segments: Named | None = None) -> Named:
    """The causal depthwise convolution of ``x`` along ``seq``: every channel (each entry of x's
    other dimensions but the batch's, those of ``weight`` but ``kernel``) convolved with its own
    ``kernel`` taps, the last tap on the current position (transformers' ``causal_conv1d_fn``
    without its activation: ``conv1d(padding=K - 1, groups=channels)[..., :seq]``); with ``segments``
    (``batch`` ``seq``) the taps before a document's start read zeros."""
    require_named("causal_conv1d", x=x, weight=weight)
    x, weight = settle(x), settle(weight)
    _whole_sequence("causal_conv1d", seq, x=x)
    channels = tuple(d for d in weight.dims if d != kernel)
    if kernel not in weight.dims or not set(channels) <= set(x.dims):
        raise ValueError(f"causal_conv1d: weight has dimensions {weight.dims}, expected x's channel dimensions "
                         f"(of {x.dims}) and {kernel!r}")
    lead = tuple(d for d in x.dims if d not in channels)
    like = dict(zip(x.dims, x.split))
    (xb, wb), vary = _aligned("causal_conv1d", [("x", x, lead + channels), ("weight", weight, channels + (kernel,))],
                              like)
    s_at, K = lead.index(seq), wb.shape[-1]
    xb = xb.movedim(s_at, -1)                                   # [..., channels..., seq]
    xp = F.pad(xb, (K - 1, 0))
    S = xb.shape[-1]
    w = wb.reshape(*((1,) * (xb.ndim - wb.ndim)), *wb.shape)     # broadcast over the leading dims
    seg = _segment_block(segments, batch, seq, like.get(batch, ()))
    if seg is None:
        out = sum(xp[..., j:j + S] * w[..., j:j + 1] for j in range(K))
    else:                                                        # a tap of another document reads zero
        if batch not in lead:
            raise ValueError(f"causal_conv1d: segments need x's batch dimension {batch!r} (x has {x.dims})")
        sp = F.pad(seg, (K - 1, 0), value=-1)
        b_at, shape = lead.index(batch), [1] * (xb.ndim - 1)
        shape[b_at] = seg.shape[0]

        def same(j: int) -> torch.Tensor:                       # [batch, seq] -> x's layout
            return (sp[:, j:j + S] == seg).to(xb.dtype).reshape(*shape, S)
        out = sum(xp[..., j:j + S] * w[..., j:j + 1] * same(j) for j in range(K))
    out = out.movedim(-1, s_at)
    split = tuple(like.get(d, ()) for d in lead + channels)
    return make_named(out, lead + channels, split, vary)


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
    seq document ids): the state starts afresh at each document's first position."""
    require_named("gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"gated_delta_rule: chunk must be a positive integer, got {chunk!r}")
    q, k, v, g, beta = (settle(x) for x in (q, k, v, g, beta))
    _whole_sequence("gated_delta_rule", seq, q=q, k=k, v=v, g=g, beta=beta)
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
    like = {batch: vs.get(batch, ()), heads: vs.get(heads, ()), kv_heads: vs.get(heads, ())}
    qk_dims, v_dims, s_dims = (batch, seq, kv_heads, head_dim), (batch, seq, heads, v_head_dim), (batch, seq, heads)
    g_dims = s_dims + (head_dim,) if head_dim in g.dims else s_dims         # (a decay per key channel: KDA)
    if head_dim in g.dims and g.split[g.dims.index(head_dim)]:
        raise ValueError(f"gated_delta_rule: g's {head_dim!r} must not be split (it is split over "
                         f"{g.split[g.dims.index(head_dim)]})")
    (qb, kb, vb, gb, bb), vary = _aligned(
        "gated_delta_rule", [("q", q, qk_dims), ("k", k, qk_dims), ("v", v, v_dims), ("g", g, g_dims),
                             ("beta", beta, s_dims)], like)
    seg = _segment_block(segments, batch, seq, like[batch])
    out = chunked_gated_delta_rule(qb, kb, vb, gb, bb, chunk, l2_normalize_qk, seg)
    split = tuple(like.get(d, ()) for d in v_dims)
    out = make_named(out, v_dims, split, vary)
    return out if out.dims == v.dims else make_named(out.data.permute([v_dims.index(d) for d in v.dims]), v.dims,
                                                     tuple(split[v_dims.index(d)] for d in v.dims), vary)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             chunk: int = 64, l2_normalize_qk: bool = True,
                             segments: torch.Tensor | None = None) -> torch.Tensor:
    """The chunked gated delta rule of plain blocks, ``q``/``k`` [B, S, Hk, Dk], ``v`` [B, S, H, Dv],
    ``beta`` [B, S, H], ``g`` [B, S, H] or, a decay per key channel (Kimi Delta Attention, as
    transformers' ``chunk_kimi_delta_attention``), [B, S, H, Dk]; [B, S, H, Dv] in v's dtype.
    ``segments`` [B, S]: document ids; a pair of positions of different documents neither mixes
    within a chunk nor through the state (each position reads the carried state only if it continues
    the document the previous chunk ended in, and only the positions of the chunk's last document
    write the state it carries on)."""
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
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    if per_channel:             # pair[i, j, d] = exp(decay_i - decay_j) of channel d (j <= i)
        pair = (decay.unsqueeze(4) - decay.unsqueeze(3)).masked_fill(upper[..., None], float("-inf")).exp()
    else:
        pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    reads = writes = carried = None
    if segments is not None:
        seg = F.pad(segments, (0, pad), value=-1).reshape(B, 1, n, chunk)       # (padding: a document of its own)
        same = (seg.unsqueeze(-1) == seg.unsqueeze(-2)).to(wide)
        pair = pair * (same[..., None] if per_channel else same)
        before = torch.cat([torch.full_like(seg[:, :, :1, -1:], -2), seg[:, :, :-1, -1:]], 2)   # previous chunk's end
        reads = (seg == before).to(wide)                                   # [B, 1, n, chunk]
        writes = (seg == seg[..., -1:]).to(wide)
        carried = (seg[..., -1:] == before).to(wide)                       # no document starts in the chunk
        if per_channel:
            reads, writes = reads[..., None], writes[..., None]
    if per_channel:             # the channels decay apart: each score sums its channels' decayed products
        system = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", k_beta, k, pair)
        intra = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", q, k, pair)
        per = lambda t: t                                      # noqa: E731  (decays already per channel)
    else:
        system = (k_beta @ k.transpose(-1, -2)) * pair         # unit lower triangular with its diagonal
        intra = (q @ k.transpose(-1, -2)) * pair
        per = lambda t: t.unsqueeze(-1)                        # noqa: E731  (one decay for every channel)
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
    state = torch.zeros(B, H, Dk, Dv, dtype=wide, device=v.device)
    outs = []
    for i in range(n):
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(B, H, n * chunk, Dv)[:, :, :S]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
