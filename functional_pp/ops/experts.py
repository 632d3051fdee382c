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

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from functional_pp._torch import is_tracing
from functional_pp.devices import mesh_view
from functional_pp.ops.quantized import is_quantized, realize, stand_in
from functional_pp.parallel.fsdp.regather import regather_scope, relayout
from functional_pp.ops.swiglu import clamped_swiglu_tensors, swiglu_tensors
from functional_pp.parallel import collectives as C
from functional_pp.parallel.named import Named, make_named, env, pvary, require_named, settle, varying_after
from functional_pp.parallel.raw_collectives import axis_index as raw_axis_index

__all__ = ["experts", "RouterStats", "load_balancing_loss", "router_z_loss", "routing_counts", "capacity", "SCORES",
           "ACTIVATIONS"]

SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
_SCORE_FNS = {"softmax": lambda t: torch.softmax(t, dim=-1), "sigmoid": torch.sigmoid,
              "sqrtsoftplus": lambda t: torch.nn.functional.softplus(t).sqrt()}     # (DeepSeek-V4)
UNARY = {"silu": torch.nn.functional.silu,
         "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
         "relu2": lambda t: torch.relu(t).square()}                    # (Nemotron 3's squared ReLU)
ACTIVATIONS = tuple(UNARY)


@dataclass(frozen=True)
class RouterStats:
    """One MoE layer's router statistics, each named and pending a sum over the mesh axes that
    split the tokens: ``counts`` the (token, expert) assignments per expert (``experts``, no
    gradient; routed, before any capacity drop), ``probs`` the summed router probabilities
    (``experts``, with gradient), ``z`` the summed squared log-partition of the router logits
    (a scalar, with gradient: the router z-loss's numerator) and ``dropped`` the assignments
    dropped for want of capacity (a scalar, no gradient; 0 when dropless); ``tokens`` the
    number of tokens (global) and ``top_k``."""

    counts: Named
    probs: Named
    tokens: int
    top_k: int
    z: Named
    dropped: Named

    def tokens_per_expert(self) -> torch.Tensor:
        """Assignments per expert over every device's tokens (a plain tensor, for metrics)."""
        return settle(self.counts).data.detach()


def _named_like(data: torch.Tensor, dims, split, vary, partial=()) -> Named:
    return make_named(data, tuple(dims), tuple(split), frozenset(vary) | frozenset(partial), frozenset(partial))


def _whole(x: Named, keep: dict[str, tuple[str, ...]] | None = None) -> tuple:
    """The target layout of ``x`` with every dimension whole except those in ``keep``."""
    keep = keep or {}
    return tuple(keep.get(d, ()) for d in x.dims)


def _local(x: Named, dims: Sequence[str]) -> torch.Tensor:
    """The block of ``x`` with its dimensions in the order ``dims``."""
    return x.data.permute([x.dims.index(d) for d in dims])


def _check_eager(dropless: bool) -> None:
    """Dropless routing has data-dependent shapes (rows per expert, split sizes): it runs
    eagerly, one device per thread or process; refuse, by name, what cannot run it."""
    if dropless and is_tracing():
        raise RuntimeError("experts: a dropless mixture of experts routes with data-dependent shapes and runs "
                           "eagerly; compile the step without it (compile: false, train_step(compile=False)), "
                           "or give the experts a static capacity (capacity_factor, docs/experts.md; a factor of at "
                           "least experts / top_k drops nothing: dropless results for experts / top_k times the "
                           "expert work)")
    mesh_view.refuse_batched(RuntimeError(
        "experts: a mixture of experts does not run on the batched simulator (its devices route different "
        "numbers of tokens); simulate with threads (--sim-mode threads, launch(simulate=True)) or processes"))


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
    return make_named(data, router.dims, tuple(split), frozenset(vary), frozenset(), router._sizes)


def experts(x: Named, router: Named, gate: Named | None, up: Named, down: Named, *, top_k: int,
            normalize: bool = False, score: str = "softmax", bias: Named | None = None,
            hidden: str = "hidden", expert_dim: str = "experts", mlp: str = "mlp",
            capacity_factor: float | None = None, groups: int = 1, topk_groups: int = 1,
            group_score: str = "top2_sum", weight_scale: float = 1.0, router_logit_bias: Named | None = None,
            expert_biases: tuple[Named, Named, Named] | None = None,
            clamp: tuple[float, ...] | None = None, weights_on_input: bool = False,
            token_capacity: int | None = None, router_x: Named | None = None,
            expert_scale: Named | None = None, activation: str = "silu",
            chosen: Named | None = None, row_padding: Named | None = None) -> tuple[Named, RouterStats]:
    """The routed experts of a mixture-of-experts layer.

    ``x`` holds tokens (any dimensions besides ``hidden``, e.g. ``batch seq hidden``);
    ``router`` is ``hidden experts``; ``gate`` and ``up`` are ``experts hidden mlp`` and
    ``down`` ``experts mlp hidden`` (in any order of those names). Each token's router
    probabilities (``score="softmax"``, Mixtral / Qwen-MoE; ``"sigmoid"``, DeepSeek-V3, whose
    ``bias`` (``experts``, no gradient) only chooses the experts; ``"sqrtsoftplus"``,
    ``sqrt(softplus(logits))``, DeepSeek-V4, with that ``bias``) pick its ``top_k`` experts,
    whose weights are renormalised to sum to 1 with ``normalize``; each expert computes
    ``down(silu(gate x) * up x)`` for exactly its tokens. Returns the weighted sum (x's
    dimensions) and the layer's :class:`RouterStats`.

    ``capacity_factor`` (None: dropless) gives every expert a fixed number of slots per
    sequence (the first token dimension's rows, e.g. ``batch``), :func:`capacity`; the
    assignments beyond it are dropped (a token then gets only its kept experts' outputs, its
    weights not renormalised) and counted in ``RouterStats.dropped``. Its shapes are static,
    so it compiles; it needs each sequence whole on a device. ``row_padding`` (the first token
    dimension's, e.g. ``batch``: each row's padding tokens before its own, left-padded prompts
    sampled together): a row's padding takes no slot and its capacity counts its own tokens, so
    its experts compute what they compute for the row alone.

    Grouped routing (DeepSeek-V2's group_limited_greedy, DeepSeek-V3, GLM-4.5): the experts in
    ``groups`` groups of consecutive experts, each token chooses among the experts of its
    ``topk_groups`` best groups only, a group scored by ``group_score`` of its experts' choice
    scores (``"top2_sum"``: its two best, DeepSeek-V3; ``"max"``: its best, DeepSeek-V2). The
    chosen weights (renormalised or not) are multiplied by ``weight_scale``
    (``routed_scaling_factor``).

    gpt-oss's options: ``router_logit_bias`` (``experts``, with gradient) is added to the router's
    logits; ``expert_biases`` (gate and up ``experts mlp``, down ``experts hidden``) are added
    after each expert's projections; ``clamp=(alpha, limit)`` makes each expert's activation
    the clamped SwiGLU (:func:`~functional_pp.ops.swiglu.clamped_swiglu_tensors`);
    ``clamp=(alpha, limit, up_offset)`` sets its offset of ``up`` (gpt-oss 1, the default;
    DeepSeek-V4's experts ``(1.0, swiglu_limit, 0.0)``: ``silu(min(g, limit)) * clamp(u)``).

    ``weights_on_input`` (Llama 4): each expert computes ``expert(weight * x)`` and the outputs
    are summed as they are (dropless only).

    ``token_capacity`` (Axolotl's ``expert_parallel_token_capacity``; dropless routing only): at
    most that many of this device's (token, expert) assignments per expert and forward, before
    any dispatch; an expert's excess, its lowest weights (ties: the earlier token, then the
    earlier choice), is dropped (weight zero), and each token's kept weights are scaled back to
    their sum before the drop (a token that keeps none gets zero). As Axolotl's expert-parallel
    plugin, it counts the tokens of one device, so it depends on how the batch is split; the
    drops are counted in ``RouterStats.dropped``.

    Gemma 4's options (and Nemotron 3's latent experts, x narrower than router_x): ``router_x`` (x's
    dimensions; None: x) is what the router scores, the
    experts computing on x; ``expert_scale`` (``experts``, with gradient) multiplies each chosen
    weight by its expert's entry, after any renormalisation; ``activation="gelu_tanh"`` makes
    each expert ``down(gelu_tanh(gate x) * up x)`` (one of :data:`ACTIVATIONS`).

    ``chosen`` (DeepSeek-V4's hash routing: ``tid2eid[input_ids]``): each token's ``top_k``
    experts given (integers; x's token dimensions and one more of size ``top_k``); the router's
    scores of them only weigh them (renormalised, scaled as above); no ``bias`` or ``groups``.

    ``gate=None`` (Nemotron 3): the experts are not gated, each ``down(act(up x))`` with
    ``activation`` (``"relu2"``: the squared ReLU), without ``clamp`` or ``expert_biases``."""
    # an adapted weight (LoRA, functional_pp/adapters/lora.py) as the one named weight it stands for
    gate, up, down = (w.__named_weight__() if hasattr(type(w), "__named_weight__") else w for w in (gate, up, down))
    # an adapted router (LoRA): its base weight here, its adapter added to the logits below
    router_lora = router if hasattr(type(router), "__named_weight__") else None
    router = router_lora.base if router_lora is not None else router
    # a quantized stack (quantize_moe_experts) planned as its stand-in, dequantized where it is used
    gated = gate is not None
    frozen = tuple(w if is_quantized(w) else None for w in (gate, up, down) if w is not None)
    gate, up, down = (stand_in(w) if q is not None else w for w, q in zip((gate, up, down) if gated else (up, up, down),
                                                                          frozen if gated else frozen[:1] + frozen))
    require_named("experts", x=x, router=router, gate=gate, up=up, down=down)
    if activation not in ACTIVATIONS or (activation != "silu" and clamp is not None):
        raise ValueError(f"experts: activation {activation!r} is not one of {', '.join(ACTIVATIONS)} (clamp: silu only)")
    if not gated and (clamp is not None or expert_biases is not None):
        raise ValueError("experts: gate=None (experts not gated) takes no clamp and no expert_biases (gpt-oss's "
                         "options are for gated experts); pass a gate weight or drop them")
    if clamp is not None and (len(clamp) not in (2, 3)
                              or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in clamp)):
        raise ValueError(f"experts: clamp must be (alpha, limit) or (alpha, limit, up_offset) numbers, got {clamp!r}")
    if chosen is not None and (bias is not None or groups > 1):
        raise ValueError("experts: chosen (experts given per token) takes no bias and no groups, which only choose "
                         "experts; drop them")
    if score not in SCORES:
        raise ValueError(f"experts: score {score!r} is not one of {', '.join(SCORES)}")
    biases = tuple(expert_biases or ())
    if expert_biases is not None and len(biases) != 3:
        raise ValueError(f"experts: expert_biases must be (gate, up, down) biases, got {len(biases)}")
    for name, w, dims in (("gate", gate, {expert_dim, hidden, mlp}), ("up", up, {expert_dim, hidden, mlp}),
                          ("down", down, {expert_dim, hidden, mlp}), ("router", router, {hidden, expert_dim}),
                          *(("router_logit_bias", router_logit_bias, {expert_dim}),) * (router_logit_bias is not None),
                          *(("expert_scale", expert_scale, {expert_dim}),) * (expert_scale is not None),
                          *zip(("gate_bias", "up_bias", "down_bias"), biases,
                               ({expert_dim, mlp}, {expert_dim, mlp}, {expert_dim, hidden}))):
        require_named("experts", **{name: w})
        if set(w.dims) != dims:
            raise ValueError(f"experts: {name} has dims {w.dims}; it needs exactly {sorted(dims)}")
    if hidden not in x.dims:
        raise ValueError(f"experts: x has dims {x.dims}, without {hidden!r}")
    if router_x is not None:
        require_named("experts", router_x=router_x)
        if router_x.dims != x.dims or router_x.size(hidden) != router.size(hidden):
            raise ValueError(f"experts: router_x has dims {router_x.dims} (hidden {router_x.size(hidden)}); it "
                             f"needs x's {x.dims} and the router's hidden {router.size(hidden)}: the same tokens, "
                             f"scored by the router")
    elif router.size(hidden) != x.size(hidden):
        raise ValueError(f"experts: router has hidden {router.size(hidden)} but x {x.size(hidden)}; pass router_x "
                         f"(what the router scores) when the experts compute on another width")
    n_experts = gate.size(expert_dim)
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"experts: top_k={top_k} must be between 1 and the number of experts ({n_experts})")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float))
                                            and not isinstance(capacity_factor, bool) and capacity_factor > 0):
        raise ValueError(f"experts: capacity_factor must be a positive number (or None: dropless), got "
                         f"{capacity_factor!r}")
    if token_capacity is not None and (isinstance(token_capacity, bool) or not isinstance(token_capacity, int)
                                       or token_capacity < 1 or capacity_factor is not None):
        raise ValueError(f"experts: token_capacity must be a positive int with dropless routing (capacity_factor "
                         f"None), got token_capacity={token_capacity!r}, capacity_factor={capacity_factor!r}")
    if weights_on_input and capacity_factor is not None:
        raise ValueError("experts: weights_on_input with capacity_factor is not supported (route dropless: "
                         "capacity_factor None)")
    mesh, _ = env()
    _check_eager(capacity_factor is None)

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
    scored = x if router_x is None else _tokens_like(router_x, x, hidden)
    r_union = x.vary | scored.vary | varying_after(router, t_router)
    router = relayout(pvary(router, r_union - varying_after(router, t_router)), t_router, "experts router")
    x_r = pvary(scored, r_union - scored.vary)
    X_r = _local(x_r, tok_dims + (hidden,)).reshape(-1, x_r.data.shape[x_r.dims.index(hidden)])
    with regather_scope([router]):
        logits = X_r @ _local(router, (hidden, expert_dim))
    if router_lora is not None:               # LoRA's scale (dropout(x) A) B, A and B whole as the router
        logits = logits + _router_adapter(router_lora, x_r, tok_dims, hidden, r_union, X_r.shape)
    if router_logit_bias is not None:         # (gpt-oss) whole, in the tokens' varying type as the router
        rb = _gather_invariant(settle(router_logit_bias), x.vary)
        rb = relayout(pvary(rb, r_union - varying_after(rb, _whole(rb))), _whole(rb), "experts router bias")
        logits = logits + rb.data
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))       # (transformers: in float32)
    probs = _SCORE_FNS[score](wide)
    correction, no_grad_term = _whole_bias(bias, x.vary) if bias is not None else (None, None)
    if chosen is not None:                          # (DeepSeek-V4's hash routing) the experts given
        idx = _chosen_rows(chosen, x, tok_dims, top_k, n_experts)
    else:
        choose = probs if bias is None else probs + correction
        if groups > 1:
            choose = _within_best_groups(choose, groups, topk_groups, group_score)
        _, idx = torch.topk(choose, top_k, dim=-1)
    weights = probs.gather(1, idx)
    if no_grad_term is not None:                    # (the correction gets a gradient of zeros, not none)
        weights = weights + no_grad_term
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if expert_scale is not None:               # (Gemma 4) whole, in the tokens' varying type as the router
        es = _gather_invariant(settle(expert_scale), x.vary)
        es = relayout(pvary(es, r_union - varying_after(es, _whole(es))), _whole(es), "experts expert_scale")
        weights = weights * es.data[idx]
    if weight_scale != 1.0:
        weights = weights * weight_scale
    planning = idx.is_meta              # a dry-run (plan/): the routing is unknown, planned balanced
    counts = (probs.new_zeros(n_experts) if planning else           # (static shapes: no bincount)
              probs.new_zeros(n_experts).scatter_add_(0, idx.reshape(-1), probs.new_ones(idx.numel())))
    capped = probs.new_zeros(())
    if token_capacity is not None and not planning:
        weights, capped = _token_capacity(idx, weights, counts, token_capacity)
    weights = weights.to(x.data.dtype)
    z = (torch.logsumexp(wide, dim=-1) ** 2).sum()                   # ST-MoE's router z-loss, summed

    def pending(v, dims=(expert_dim,)) -> Named:
        return _named_like(v, dims, ((),) * len(dims), r_union, token_axes)

    # --- the experts: their expert split kept (expert parallelism), hidden whole, mlp kept (TP)
    e_axes = gate.split[gate.dims.index(expert_dim)]
    m_axes = gate.split[gate.dims.index(mlp)]
    for name, w in (("up", up), ("down", down)):
        if (w.split[w.dims.index(expert_dim)], w.split[w.dims.index(mlp)]) != (e_axes, m_axes):
            raise ValueError(f"experts: {name} splits {expert_dim!r} over {w.split[w.dims.index(expert_dim)]} and "
                             f"{mlp!r} over {w.split[w.dims.index(mlp)]}, but gate over {e_axes} and {m_axes}: "
                             f"the three expert weights need one layout (give them the same dimension names)")
    ws = [settle(w) for w in ((gate,) if gated else ()) + (up, down, *biases)]
    targets = [_whole(w, {expert_dim: e_axes, mlp: m_axes}) for w in ws]
    union = set(r_union)
    for w, t in zip(ws, targets):
        union |= varying_after(w, t)
    dtype = x.data.dtype
    ws = [pvary(realize(q, t, dtype, "experts"), union - varying_after(w, t)) if q is not None else
          relayout(pvary(w, union - varying_after(w, t)), t, "experts")
          for w, t, q in zip(ws, targets, frozen + (None,) * len(biases))]
    x_e = pvary(x, union - x.vary)
    X = _local(x_e, tok_dims + (hidden,)).reshape(X_r.shape[0], -1)
    w_e = C.pvary(weights, tuple(a for a in mesh.axis_names if a in union - r_union)) if union - r_union else weights

    # --- which device holds each chosen expert: its block of the experts split
    sizes = [mesh.shape[a] for a in e_axes]
    n_local = n_experts // _prod(sizes)
    a2a = tuple(a for a in e_axes if a in x.vary)               # tokens differ there: dispatch
    part = tuple(a for a in e_axes if a not in x.vary)          # tokens equal there: a pending sum
    ffn = _ExpertMLP(ws, (expert_dim, hidden, mlp), clamp, _prod([mesh.shape[a] for a in m_axes]), activation, gated)
    if capacity_factor is not None:
        pad = None
        if row_padding is not None:
            if row_padding.dims != tok_dims[:1] or row_padding.split[0] != x.split[0]:
                raise ValueError(f"experts: row_padding {row_padding!r} must be x's first token dimension "
                                 f"{tok_dims[0]!r}, laid out as x's ({x.split[0]})")
            pad = row_padding.data.to(device=X.device, dtype=torch.long)
        y, dropped = _capacity_experts(X, idx, w_e, ffn, x, tok_dims, top_k, capacity_factor, n_local,
                                       e_axes, sizes, a2a, part, pad)
    else:
        y, dropped = _dropless_experts(X, idx, w_e, ffn, top_k, n_local, e_axes, sizes, a2a, part,
                                       planning, weights_on_input), capped
    stats = RouterStats(pending(counts), pending(probs.sum(0)), n_tokens, top_k, pending(z, ()),
                        pending(dropped.to(probs.dtype), ()))
    shape = [x.data.shape[x.dims.index(d)] for d in tok_dims] + [y.shape[-1]]
    split = [x.split[x.dims.index(d)] for d in tok_dims] + [()]
    out = _named_like(y.reshape(shape), tok_dims + (hidden,), split, union, set(m_axes) | set(part))
    return out, stats


def _tokens_like(t: Named, x: Named, hidden: str) -> Named:
    """``t`` laid out as the settled ``x`` (its dimensions in x's order, split as x, hidden whole)."""
    if t.dims != x.dims:
        raise ValueError(f"experts: router_x's dims {t.dims} are not in x's order {x.dims}")
    return relayout(settle(t), tuple(x.split), "experts router_x")


def _chosen_rows(chosen: Named, x: Named, tok_dims: tuple[str, ...], top_k: int, n_experts: int) -> torch.Tensor:
    """The given experts of this device's tokens as a (tokens, top_k) index tensor, in x's token
    order: ``chosen`` laid out as x along the token dimensions, its extra dimension whole."""
    require_named("experts", chosen=chosen)
    extra = [d for d in chosen.dims if d not in tok_dims]
    if (set(tok_dims) - set(chosen.dims) or len(extra) != 1 or chosen.size(extra[0]) != top_k
            or chosen.data.is_floating_point() or chosen.data.is_complex()):
        raise ValueError(f"experts: chosen has dims {chosen.dims} (sizes {tuple(chosen.data.shape)}, "
                         f"{chosen.data.dtype}); it needs x's token dims {tok_dims} and one more of size top_k="
                         f"{top_k}, integer expert indices below {n_experts}")
    c = settle(chosen)
    c = relayout(c, tuple(x.split[x.dims.index(d)] if d in tok_dims else () for d in c.dims), "experts chosen")
    idx = _local(c, tok_dims + (extra[0],)).reshape(-1, top_k).long()
    if idx.numel() and not idx.is_meta and not is_tracing() and not 0 <= int(idx.min()) <= int(idx.max()) < n_experts:
        raise ValueError(f"experts: chosen holds expert indices {int(idx.min())}..{int(idx.max())}; each must be "
                         f"below the number of experts ({n_experts}) and not negative (a hash table of this model?)")
    return idx


def _token_capacity(idx: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                    cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, dropped)``: the (tokens, top_k) ``weights`` with each expert's assignments
    beyond ``cap`` zeroed, its lowest weights first (ties: the earlier assignment in token-major
    order), and each token's kept weights scaled to their sum before the drop; ``counts`` are
    the assignments per expert. Static shapes (two stable sorts, no data-dependent sizes)."""
    flat_e, flat_w = idx.reshape(-1), weights.detach().reshape(-1)
    by_weight = torch.argsort(flat_w, descending=True, stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]     # by expert, then weight
    starts = torch.cumsum(counts, 0).to(torch.int64) - counts.to(torch.int64)
    rank = torch.arange(order.numel(), device=idx.device) - starts[flat_e[order]]
    keep = torch.empty_like(rank, dtype=torch.bool)
    keep[order] = rank < cap
    kept = keep.reshape(idx.shape).to(weights.dtype)
    before, after = weights.sum(-1, keepdim=True), (weights * kept).sum(-1, keepdim=True)
    some = after > 0
    scale = torch.where(some, before / torch.where(some, after, torch.ones_like(after)), torch.ones_like(after))
    return weights * kept * scale, (~keep).sum().to(weights.dtype)


def _router_adapter(lora, x_r: Named, tok_dims: tuple, hidden: str, r_union: frozenset, shape) -> torch.Tensor:
    """An adapted router's term of the logits, peft's ``scale * (dropout(x) A) B`` as local rows
    (tokens, experts): ``lora_A`` (``hidden lora_r``) and ``lora_B`` (``lora_r experts``) gathered
    whole in the tokens' varying type, as the router is; the dropout mask is the layout-free one
    of :func:`functional_pp.ops.dropout.dropout` (each token's own on every layout)."""
    from functional_pp.ops.dropout import dropout
    if getattr(lora, "magnitude", None) is not None:
        raise ValueError("experts: DoRA on the router is not supported; target the router with LoRA only")
    ab = []
    for w in (lora.lora_A, lora.lora_B):
        w = _gather_invariant(settle(w), x_r.vary)
        t = _whole(w)
        ab.append(relayout(pvary(w, r_union - varying_after(w, t)), t, "experts router adapter"))
    a, b = ab
    xd = dropout(x_r, lora.dropout, lora.seed) if lora.dropout else x_r
    X = _local(xd, tok_dims + (hidden,)).reshape(shape)
    with regather_scope([a, b]):
        return (X @ _local(a, a.dims)) @ _local(b, b.dims) * lora.scale


def _whole_bias(bias: Named, token_vary: frozenset) -> tuple[torch.Tensor, torch.Tensor]:
    """The score correction (``experts``) whole on every device, as a plain tensor without
    gradient, and a zero that depends on it (added to the weights: the correction's gradient is
    zeros, so that a step treats it as any parameter while it stays what it is)."""
    b = _gather_invariant(settle(bias), token_vary)
    if any(b.split):
        b = relayout(b, _whole(b), "experts bias")
    return b.data.detach().float(), (b.data * 0).sum()


def _within_best_groups(choose: torch.Tensor, groups: int, topk_groups: int, group_score: str) -> torch.Tensor:
    """The (tokens, experts) choice scores with the experts outside each token's ``topk_groups``
    best groups (of ``groups`` consecutive experts, scored by ``group_score``) at -inf."""
    n_tokens, n_experts = choose.shape
    if n_experts % groups or not 1 <= topk_groups <= groups:
        raise ValueError(f"experts: groups={groups} must divide the {n_experts} experts and topk_groups="
                         f"{topk_groups} be between 1 and groups")
    if group_score not in ("top2_sum", "max"):
        raise ValueError(f"experts: group_score {group_score!r} is not one of top2_sum, max")
    per_group = choose.view(n_tokens, groups, n_experts // groups)
    score = per_group.max(-1).values if group_score == "max" else per_group.topk(min(2, n_experts // groups),
                                                                                  dim=-1)[0].sum(-1)
    best = torch.topk(score, topk_groups, dim=-1)[1]
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
    return choose.masked_fill(~keep.repeat_interleave(n_experts // groups, 1), float("-inf"))


def _prod(xs) -> int:
    """The product of a list of ints (traceable: dynamo does not trace ``math.prod``)."""
    out = 1
    for x in xs:
        out *= x
    return out


class _ExpertMLP:
    """This device's experts as plain tensors: ``one(rows, j)`` runs local expert ``j`` on its
    rows, ``batched(rows)`` every local expert on its block of ``rows`` (local experts, n,
    hidden); with the biases (gpt-oss) after the projections, the down bias divided over the
    ``m_shards`` devices whose partial sums of ``mlp`` make the output (so it counts once).
    Not ``gated``: ``ws`` without the gate, each expert ``down(act(up rows))``."""

    def __init__(self, ws: list[Named], names, clamp, m_shards: int, activation: str = "silu", gated: bool = True):
        expert_dim, hidden, mlp = names
        self.named = ws
        dims = ((expert_dim, hidden, mlp), (expert_dim, hidden, mlp), (expert_dim, mlp, hidden),
                (expert_dim, mlp), (expert_dim, mlp), (expert_dim, hidden))
        self.g, self.u, self.d, *self.b = (_local(w, d) for w, d in zip(ws if gated else ws[:1] + ws, dims))
        unary = UNARY[activation]
        self.act = ((lambda g, u: unary(u)) if not gated else
                    swiglu_tensors if clamp is None and activation == "silu" else
                    (lambda g, u: unary(g) * u) if clamp is None else
                    lambda g, u: clamped_swiglu_tensors(g, u, alpha=clamp[0], limit=clamp[1],
                                                        up_offset=clamp[2] if len(clamp) > 2 else 1.0))
        self.gated = gated
        self.down_share = 1.0 / m_shards

    def _down_bias(self, db: torch.Tensor) -> torch.Tensor:
        return db if self.down_share == 1 else db * self.down_share

    def one(self, rows: torch.Tensor, j: int) -> torch.Tensor:
        u = rows @ self.u[j]
        g = rows @ self.g[j] if self.gated else u
        if not self.b:
            return self.act(g, u) @ self.d[j]
        gb, ub, db = self.b
        return (self.act(g + gb[j], u + ub[j]) @ self.d[j]) + self._down_bias(db[j])

    def batched(self, rows: torch.Tensor) -> torch.Tensor:
        u = torch.bmm(rows, self.u)
        g = torch.bmm(rows, self.g) if self.gated else u
        if not self.b:
            return torch.bmm(self.act(g, u), self.d)
        gb, ub, db = self.b
        return torch.bmm(self.act(g + gb[:, None], u + ub[:, None]), self.d) + self._down_bias(db[:, None])


def _block_coords(idx: torch.Tensor, n_local: int, e_axes, sizes) -> dict[str, torch.Tensor]:
    """Per (token, expert) pair, the coordinate along each of the experts' mesh axes of the
    device holding the expert (its block of the experts split, first axis major)."""
    block = idx.reshape(-1) // n_local
    coords = {}
    for a, s in zip(reversed(e_axes), reversed(sizes)):
        coords[a] = block % s
        block = block // s
    return coords


def _dropless_experts(X, idx, w_e, ffn, top_k, n_local, e_axes, sizes, a2a, part, planning, on_input=False):
    """Every (token, expert) pair sorted by (device, expert), sent with the uneven all-to-all
    (split sizes exchanged first), each local expert on exactly its rows, and back."""
    mesh, _ = env()
    coords = _block_coords(idx, n_local, e_axes, sizes)
    keep = torch.ones_like(idx.reshape(-1), dtype=torch.bool)
    for a in part:
        keep &= coords[a] == raw_axis_index(a)
    dest = torch.zeros_like(idx.reshape(-1))
    for a in a2a:
        dest = dest * mesh.shape[a] + coords[a]
    n_dest = _prod([mesh.shape[a] for a in a2a])
    if planning:                        # every expert gets its share of the tokens' assignments
        per = -(-X.shape[0] * top_k // (n_local * _prod(sizes)))
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
    if on_input:                        # (Llama 4) the weights scale the experts' input, not their output
        rows = rows * w_sorted[:, None]
    if a2a:
        rows = C.all_to_all_v(rows, a2a, send, recv)
    expert_of_row = torch.arange(n_local).repeat(recv_counts.shape[0]).repeat_interleave(recv_counts.reshape(-1))
    perm = torch.argsort(expert_of_row, stable=True).to(rows.device)
    grouped = rows[perm]
    # every local expert runs, with no rows too: the backward's FSDP re-gathers of the experts
    # (one per saved weight) are then the same on every device, whatever the routing
    with regather_scope(ffn.named):
        outs = [ffn.one(seg, j) for j, seg in enumerate(grouped.split(recv_counts.sum(0).tolist()))]
    out_rows = torch.cat(outs)
    out_rows = out_rows[torch.argsort(perm)]
    if a2a:
        out_rows = C.all_to_all_v(out_rows, a2a, recv, send)
    return X.new_zeros(X.shape[0], out_rows.shape[-1]).index_add(
        0, t_sorted, out_rows if on_input else out_rows * w_sorted[:, None])


def capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Each expert's slots for one sequence of ``tokens`` tokens: ``ceil(capacity_factor *
    tokens * top_k / n_experts)`` (the share of a balanced routing times the factor), at least
    1 and at most ``tokens`` (an expert meets each token at most once)."""
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / n_experts)))


def _capacity_experts(X, idx, w_e, ffn, x, tok_dims, top_k, capacity_factor, n_local, e_axes, sizes, a2a, part,
                      pad=None):
    """Static shapes: every expert has :func:`capacity` slots per sequence (a row of the first
    token dimension), filled in the order (row, choice, position): every token's first choice
    before any token's second, earlier positions first; the assignments past the capacity are
    dropped (with ``pad``, each row's leading padding tokens: those take no slot and a row keeps
    the capacity of its own tokens, at most the buffer's). The slots (R rows x E experts x cap,
    empty ones computing a token whose output is not used) go to the experts' devices with an
    even all-to-all and come back with its transpose; returns the combined output and the
    number of dropped assignments (a row's padding not counted)."""
    split = [(d, x.split[x.dims.index(d)]) for d in tok_dims[1:] if x.split[x.dims.index(d)]]
    if split:
        raise ValueError(f"experts: capacity_factor gives each sequence (a row of {tok_dims[0]!r}) its experts' "
                         f"slots, so a sequence must be whole on a device, but {split[0][0]!r} is split over "
                         f"{split[0][1]}; route dropless (capacity_factor None) with the sequence split (cp)")
    dev = X.device
    R = x.data.shape[x.dims.index(tok_dims[0])]
    S = X.shape[0] // R
    E = n_local * _prod(sizes)
    cap = capacity(S, top_k, E, capacity_factor)
    a = idx.reshape(R, S, top_k).transpose(1, 2).reshape(R, top_k * S)
    w_a = w_e.reshape(R, S, top_k).transpose(1, 2).reshape(-1)
    rows_of = torch.arange(R, device=dev)[:, None]
    tok = (rows_of * S + torch.arange(S, device=dev).repeat(top_k)[None]).reshape(-1)
    onehot = torch.zeros(R, top_k * S, E, dtype=torch.int32, device=dev).scatter_(2, a[..., None], 1)
    real = None
    if pad is not None:                             # (a row's padding queues for no slot)
        real = (torch.arange(S, device=dev)[None] >= pad[:, None]).repeat(1, top_k)
        onehot = onehot * real[..., None].to(onehot.dtype)
    slot = onehot.cumsum(1, dtype=torch.int32).gather(2, a[..., None]).squeeze(2).long() - 1   # its place in the queue
    kept = slot < cap
    if real is not None:
        own = (S - pad).clamp_min(1)
        row_cap = torch.minimum(own, torch.ceil(capacity_factor * own.double() * top_k / E).long()).clamp_min(1)
        kept = kept & real & (slot < row_cap[:, None])
    n_slots = R * E * cap
    where = torch.where(kept, (rows_of * E + a) * cap + slot, n_slots).reshape(-1)
    slot_token = torch.zeros(n_slots + 1, dtype=torch.int64, device=dev).scatter_(0, where, tok)[:n_slots]

    # --- the slots to the experts' devices: along part axes only this device's block is kept
    rows = X[slot_token].reshape(R, *sizes, n_local, cap, X.shape[-1])
    for a_name in reversed(part):
        rows = rows.select(1 + e_axes.index(a_name), raw_axis_index(a_name))
    a2a_sizes = [s for a_name, s in zip(e_axes, sizes) if a_name in a2a]
    n_dest = _prod(a2a_sizes)
    rows = rows.movedim(0, -3).reshape(n_dest * n_local * R * cap, X.shape[-1])
    if a2a:
        rows = C.all_to_all(rows, a2a, 0, 0, tiled=True)
    rows = rows.reshape(n_dest, n_local, R * cap, -1).transpose(0, 1).reshape(n_local, n_dest * R * cap, -1)
    with regather_scope(ffn.named):
        out = ffn.batched(rows)
    h_out = out.shape[-1]
    out = out.reshape(n_local, n_dest, R * cap, h_out).transpose(0, 1).reshape(-1, h_out)
    if a2a:
        out = C.all_to_all(out, a2a, 0, 0, tiled=True)
    out = out.reshape(*a2a_sizes, n_local, R, cap, h_out).movedim(-3, 0).reshape(-1, h_out)

    # --- combine: each kept assignment's slot in this device's part of the buffer
    flat_a = a.reshape(-1)
    coords = _block_coords(flat_a, n_local, e_axes, sizes)
    valid = kept.reshape(-1)
    for a_name in part:
        valid = valid & (coords[a_name] == raw_axis_index(a_name))
    block = torch.zeros_like(flat_a)
    for a_name in a2a:
        block = block * env()[0].shape[a_name] + coords[a_name]
    e_here = n_dest * n_local
    at = ((rows_of.expand(R, top_k * S).reshape(-1) * e_here + block * n_local + flat_a % n_local) * cap
          + slot.reshape(-1))
    at = torch.where(valid, at, 0)
    contrib = out[at] * (w_a * valid.to(w_a.dtype))[:, None]
    y = X.new_zeros(X.shape[0], h_out).index_add(0, tok, contrib)
    return y, (~kept if real is None else real & ~kept).sum()


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


def router_z_loss(stats: Sequence[RouterStats]) -> Named:
    """The router z-loss of ST-MoE (Zoph et al. 2022) over every layer's statistics, as
    transformers' ``router_z_loss_func`` over the layers' router logits taken together: the
    mean over every layer's tokens of ``logsumexp(logits)^2``. A named scalar, with gradient."""
    stats = list(stats)
    if not stats:
        raise ValueError("router_z_loss: no router statistics (a model without MoE layers)")
    zs = [settle(s.z) for s in stats]
    rows = float(sum(s.tokens for s in stats))
    value = torch.stack([z.data for z in zs]).sum() / rows
    return _named_like(value, (), (), frozenset().union(*(z.vary for z in zs)))


def routing_counts(stats: Sequence[RouterStats]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's assignments per expert ``(layers, experts)`` and dropped assignments
    ``(layers,)``, global (summed over the devices' tokens) in one all-reduce; plain tensors
    without gradient, for metrics."""
    stats = list(stats)
    table = torch.cat([torch.stack([s.counts.data.detach() for s in stats]).reshape(-1),
                       torch.stack([s.dropped.data.detach() for s in stats])])
    # (every layer's statistics pend the same sum: one all-reduce for all)
    table = settle(_named_like(table, ("moe_stats",), ((),), stats[0].counts.vary, stats[0].counts.partial)).data
    return table[:-len(stats)].reshape(len(stats), -1), table[-len(stats):]
