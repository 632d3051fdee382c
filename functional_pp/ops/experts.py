"""A mixture of experts as one named op: a router scores every token, each token goes to its
``top_k`` experts (dropless: no capacity, no token dropped), each expert is a gated MLP, and the
outputs are summed with the routing weights (docs/experts.md).

The experts are parameters with an ``experts`` dimension. Splitting that dimension over mesh
axes by a rule is expert parallelism, derived like every other layout:

* over axes the tokens are split over (``experts=("dp_shard",)``, the batch's axis; or a new
  ``ep`` axis that ``batch`` also uses), each device sends every (token, expert) pair to the
  device holding the expert with an uneven all-to-all (the split sizes exchanged first) and
  gets the results back with its transpose, the inverse all-to-all;
* over axes the tokens are not split over, every device computes its own experts for all of
  its tokens and the output is a pending sum over those axes (settled by the residual add).

``mlp`` split over ``tp`` inside the experts is Megatron's MLP (a pending sum over ``tp``);
FSDP of the experts along ``hidden`` gathers them as any weight. The router's statistics
(tokens per expert, summed router probabilities) come back as :class:`RouterStats`, from which
:func:`load_balancing_loss` computes the Switch / Mixtral auxiliary loss exactly as
``transformers``' ``load_balancing_loss_func`` (over every layer and every device's tokens)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from functional_pp._torch import is_tracing
from functional_pp.core.runtime import current_context
from functional_pp.ops.regather import regather_scope, relayout
from functional_pp.ops.swiglu import swiglu_tensors
from functional_pp.parallel import collectives as C
from functional_pp.parallel.named import Named, _make, env, pvary, require_named, settle, varying_after
from functional_pp.parallel.raw_collectives import axis_index as raw_axis_index

__all__ = ["experts", "RouterStats", "load_balancing_loss", "SCORES"]

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RouterStats:
    """One MoE layer's router statistics, each a named ``(experts,)`` vector pending a sum over
    the mesh axes that split the tokens: ``counts`` the (token, expert) assignments per expert
    (no gradient), ``probs`` the summed router probabilities (with gradient); ``tokens`` the
    number of tokens (global) and ``top_k``."""

    counts: Named
    probs: Named
    tokens: int
    top_k: int

    def tokens_per_expert(self) -> torch.Tensor:
        """Assignments per expert over every device's tokens (a plain tensor, for metrics)."""
        return settle(self.counts).data.detach()


def _named_like(data: torch.Tensor, dims, split, vary, partial=()) -> Named:
    return _make(data, tuple(dims), tuple(split), frozenset(vary) | frozenset(partial), frozenset(partial))


def _whole(x: Named, keep: dict[str, tuple[str, ...]] | None = None) -> tuple:
    """The target layout of ``x`` with every dimension whole except those in ``keep``."""
    keep = keep or {}
    return tuple(keep.get(d, ()) for d in x.dims)


def _local(x: Named, dims: Sequence[str]) -> torch.Tensor:
    """The block of ``x`` with its dimensions in the order ``dims``."""
    return x.data.permute([x.dims.index(d) for d in dims])


def _check_eager() -> None:
    """Dropless routing has data-dependent shapes (rows per expert, split sizes): it runs
    eagerly, one device per thread or process; refuse, by name, what cannot run it."""
    if is_tracing():
        raise RuntimeError("experts: a dropless mixture of experts routes with data-dependent shapes and runs "
                           "eagerly; compile the step without it (compile: false, train_step(compile=False))")
    ctx = current_context(required=False)
    if ctx is not None and ctx.batched:
        raise RuntimeError("experts: a mixture of experts does not run on the batched simulator (its devices "
                           "route different numbers of tokens); simulate with threads (--sim-mode threads, "
                           "launch(simulate=True)) or processes")


def _gather_invariant(router: Named, token_vary: frozenset) -> Named:
    """The router gathered along the dimensions split over axes that the tokens do not vary
    over (``experts`` over a separate ``ep`` axis): every device there routes the same tokens
    identically, so the gathered router is invariant there and its gradient is this device's
    slice (``all_gather(invariant=True)``), not a sum of identical copies."""
    data, split, vary = router.data, list(router.split), set(router.vary)
    for d, axes in enumerate(router.split):
        outside = [a for a in axes if a not in token_vary]
        if not outside:
            continue
        if len(outside) != len(axes):
            raise ValueError(f"experts: the router's {router.dims[d]!r} is split over {axes}, of which the tokens "
                             f"vary over some only; split it over axes the batch uses, or over axes it does not")
        data = C.all_gather(data, axes, axis=d, tiled=True, invariant=True)
        split[d] = ()
        vary -= set(axes)
    if data is router.data:
        return router
    return _make(data, router.dims, tuple(split), frozenset(vary), frozenset(), router._sizes)


def experts(x: Named, router: Named, gate: Named, up: Named, down: Named, *, top_k: int,
            normalize: bool = False, score: str = "softmax", bias: Named | None = None,
            hidden: str = "hidden", expert_dim: str = "experts", mlp: str = "mlp") -> tuple[Named, RouterStats]:
    """The routed experts of a mixture-of-experts layer.

    ``x`` holds tokens (any dimensions besides ``hidden``, e.g. ``batch seq hidden``);
    ``router`` is ``hidden experts``; ``gate`` and ``up`` are ``experts hidden mlp`` and
    ``down`` ``experts mlp hidden`` (in any order of those names). Each token's router
    probabilities (``score="softmax"``, Mixtral / Qwen-MoE; ``"sigmoid"``, DeepSeek-V3, whose
    ``bias`` (``experts``, no gradient) only chooses the experts) pick its ``top_k`` experts,
    whose weights are renormalised to sum to 1 with ``normalize``; each expert computes
    ``down(silu(gate x) * up x)`` for exactly its tokens. Returns the weighted sum (x's
    dimensions) and the layer's :class:`RouterStats`."""
    require_named("experts", x=x, router=router, gate=gate, up=up, down=down)
    if score not in SCORES:
        raise ValueError(f"experts: score {score!r} is not one of {', '.join(SCORES)}")
    for name, w, dims in (("gate", gate, {expert_dim, hidden, mlp}), ("up", up, {expert_dim, hidden, mlp}),
                          ("down", down, {expert_dim, hidden, mlp}), ("router", router, {hidden, expert_dim})):
        if set(w.dims) != dims:
            raise ValueError(f"experts: {name} has dims {w.dims}; it needs exactly {sorted(dims)}")
    if hidden not in x.dims:
        raise ValueError(f"experts: x has dims {x.dims}, without {hidden!r}")
    n_experts = gate.size(expert_dim)
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"experts: top_k={top_k} must be between 1 and the number of experts ({n_experts})")
    mesh, _ = env()
    _check_eager()

    # --- the tokens, whole along hidden; the axes that split them
    x = settle(x)
    x = relayout(x, tuple(() if d == hidden else s for d, s in zip(x.dims, x.split)), "experts")
    tok_dims = tuple(d for d in x.dims if d != hidden)
    token_axes = tuple(a for a in mesh.axis_names if any(a in s for s in x.split))
    n_tokens = 1
    for d in tok_dims:
        n_tokens *= x.size(d)

    # --- the router, whole, in the tokens' varying type
    router = _gather_invariant(settle(router), x.vary)
    t_router = _whole(router)
    r_union = x.vary | varying_after(router, t_router)
    router = relayout(pvary(router, r_union - varying_after(router, t_router)), t_router, "experts router")
    x_r = pvary(x, r_union - x.vary)
    X_r = _local(x_r, tok_dims + (hidden,)).reshape(-1, x.data.shape[x.dims.index(hidden)])
    with regather_scope([router]):
        logits = X_r @ _local(router, (hidden, expert_dim))
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))       # (transformers: in float32)
    probs = torch.softmax(wide, dim=-1) if score == "softmax" else torch.sigmoid(wide)
    choose = probs if bias is None else probs + settle(bias).data.detach().float()
    _, idx = torch.topk(choose, top_k, dim=-1)
    weights = probs.gather(1, idx)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.data.dtype)
    planning = idx.is_meta              # a dry-run (plan/): the routing is unknown, planned balanced
    counts = (probs.new_zeros(n_experts) if planning else
              torch.bincount(idx.reshape(-1), minlength=n_experts).to(probs.dtype))
    stats = RouterStats(_named_like(counts, (expert_dim,), ((),), r_union, token_axes),
                        _named_like(probs.sum(0), (expert_dim,), ((),), r_union, token_axes), n_tokens, top_k)

    # --- the experts: their expert split kept (expert parallelism), hidden whole, mlp kept (TP)
    e_axes = gate.split[gate.dims.index(expert_dim)]
    m_axes = gate.split[gate.dims.index(mlp)]
    for name, w in (("up", up), ("down", down)):
        if (w.split[w.dims.index(expert_dim)], w.split[w.dims.index(mlp)]) != (e_axes, m_axes):
            raise ValueError(f"experts: {name} splits {expert_dim!r} over {w.split[w.dims.index(expert_dim)]} and "
                             f"{mlp!r} over {w.split[w.dims.index(mlp)]}, but gate over {e_axes} and {m_axes}: "
                             f"the three expert weights need one layout (give them the same dimension names)")
    ws = [settle(w) for w in (gate, up, down)]
    targets = [_whole(w, {expert_dim: e_axes, mlp: m_axes}) for w in ws]
    union = set(r_union)
    for w, t in zip(ws, targets):
        union |= varying_after(w, t)
    ws = [relayout(pvary(w, union - varying_after(w, t)), t, "experts") for w, t in zip(ws, targets)]
    x_e = pvary(x, union - x.vary)
    X = _local(x_e, tok_dims + (hidden,)).reshape(X_r.shape)
    w_e = C.pvary(weights, tuple(a for a in mesh.axis_names if a in union - r_union)) if union - r_union else weights

    # --- which device holds each chosen expert: its block of the experts split
    sizes = [mesh.shape[a] for a in e_axes]
    n_local = n_experts
    for s in sizes:
        n_local //= s
    a2a = tuple(a for a in e_axes if a in x.vary)               # tokens differ there: dispatch
    part = tuple(a for a in e_axes if a not in x.vary)          # tokens equal there: a pending sum
    block = idx.reshape(-1) // n_local
    coords = {}
    for a, s in zip(reversed(e_axes), reversed(sizes)):
        coords[a] = block % s
        block = block // s
    keep = torch.ones_like(idx.reshape(-1), dtype=torch.bool)
    for a in part:
        keep &= coords[a] == raw_axis_index(a)
    dest = torch.zeros_like(idx.reshape(-1))
    for a in a2a:
        dest = dest * mesh.shape[a] + coords[a]
    n_dest = 1
    for a in a2a:
        n_dest *= mesh.shape[a]
    if planning:                        # every expert gets its share of the tokens' assignments
        per = -(-X.shape[0] * top_k // n_experts)
        send_counts = recv_counts = torch.full((n_dest, n_local), per, dtype=torch.long)
        t_sorted = torch.zeros(n_dest * n_local * per, dtype=torch.long, device=X.device)
        w_sorted = w_e.reshape(-1)[t_sorted]
    else:
        local_expert = idx.reshape(-1) % n_local
        token = torch.arange(X.shape[0], device=X.device).repeat_interleave(top_k)
        key = (dest * n_local + local_expert)[keep]
        order = torch.argsort(key, stable=True)
        t_sorted, key_sorted = token[keep][order], key[order]
        w_sorted = w_e.reshape(-1)[keep][order]
        send_counts = torch.bincount(key_sorted, minlength=n_dest * n_local).reshape(n_dest, n_local)
        recv_counts = C.exchange_sizes(send_counts, a2a) if a2a else send_counts
    send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()

    # --- dispatch, the experts, combine (the transpose of the dispatch)
    rows = X[t_sorted]
    if a2a:
        rows = C.all_to_all_v(rows, a2a, send, recv)
    expert_of_row = torch.arange(n_local).repeat(recv_counts.shape[0]).repeat_interleave(recv_counts.reshape(-1))
    perm = torch.argsort(expert_of_row, stable=True).to(rows.device)
    grouped = rows[perm]
    g_w, u_w, d_w = (_local(w, dims) for w, dims in zip(
        ws, ((expert_dim, hidden, mlp), (expert_dim, hidden, mlp), (expert_dim, mlp, hidden))))
    # every local expert runs, with no rows too: the backward's FSDP re-gathers of the experts
    # (one per saved weight) are then the same on every device, whatever the routing
    with regather_scope(ws):
        outs = [swiglu_tensors(seg @ g_w[j], seg @ u_w[j]) @ d_w[j]
                for j, seg in enumerate(grouped.split(recv_counts.sum(0).tolist()))]
    out_rows = torch.cat(outs)
    out_rows = out_rows[torch.argsort(perm)]
    if a2a:
        out_rows = C.all_to_all_v(out_rows, a2a, recv, send)
    y = X.new_zeros(X.shape[0], out_rows.shape[-1]).index_add(0, t_sorted, out_rows * w_sorted[:, None])
    shape = [x.data.shape[x.dims.index(d)] for d in tok_dims] + [y.shape[-1]]
    split = [x.split[x.dims.index(d)] for d in tok_dims] + [()]
    out = _named_like(y.reshape(shape), tok_dims + (hidden,), split, union, set(m_axes) | set(part))
    return out, stats


def load_balancing_loss(stats: Sequence[RouterStats]) -> Named:
    """The Switch Transformer auxiliary loss over every layer's statistics, as transformers'
    ``load_balancing_loss_func`` (Mixtral, Qwen-MoE): ``E * sum_e f_e * P_e`` where ``f_e`` is
    the fraction of (token, expert) assignments counted over all layers and tokens, divided by
    the tokens times layers, and ``P_e`` the router probability of expert e averaged the same
    way. A named scalar; its gradient flows through the probabilities only."""
    stats = list(stats)
    if not stats:
        raise ValueError("load_balancing_loss: no router statistics (a model without MoE layers)")
    # (summed as this device's whole vectors: a named sum would lay ``experts`` out by the rules)
    counts = [settle(s.counts) for s in stats]
    probs = [settle(s.probs) for s in stats]
    rows = float(sum(s.tokens for s in stats))
    n_experts = counts[0].data.shape[0]
    c = torch.stack([x.data.detach() for x in counts]).sum(0)
    p = torch.stack([x.data for x in probs]).sum(0)
    value = (c / rows * (p / rows)).sum() * n_experts
    return _named_like(value, (), (), frozenset().union(*(x.vary for x in probs)))
