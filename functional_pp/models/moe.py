"""The mixture-of-experts MLP of the decoder (Mixtral, Qwen3-MoE, Qwen2-MoE; docs/experts.md):
its parameter declarations, the block that replaces the dense MLP in the layers that have
experts, and the collection of every layer's router statistics for the auxiliary
load-balancing loss.

Parameters of one MoE MLP (``E`` experts of intermediate size ``F``, hidden ``H``):

    router        [H, E]     hidden experts       (HF ``mlp.gate.weight`` [E, H])
    gate, up      [E, H, F]  experts hidden mlp   (HF ``mlp.experts.{j}.gate_proj/up_proj.weight`` [F, H])
    down          [E, F, H]  experts mlp hidden   (HF ``mlp.experts.{j}.down_proj.weight`` [H, F])

and with a shared expert (Qwen2-MoE) ``shared_expert.{gate_proj, up_proj, down_proj}`` (a dense
MLP, ``hidden mlp``) and ``shared_expert_gate`` [H] (its sigmoid gate). With ``mlp_gated=False``
(Nemotron 3) there is no ``gate`` (nor the shared expert's ``gate_proj``): each expert is
``down(act(up x))``, ``act`` the config's ``mlp_act``. ``experts`` is the
dimension that a rule splits for expert parallelism (``Rules(experts="ep")``)."""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from functional_pp import ops
from functional_pp.core import step_values
from functional_pp.models import kv_cache
from functional_pp.ops.experts import RouterStats, experts, load_balancing_loss, router_z_loss, routing_counts
from functional_pp.parallel.named import Named

__all__ = ["init_mlp", "mlp_block", "collect", "aux_loss", "z_loss", "router_losses", "report_routing", "is_moe_layer",
           "beside_mlp"]

_store = step_values.Collections()      # the open collect()s of each device (thread)


def is_moe_layer(cfg, i: int) -> bool:
    """Whether layer ``i`` of ``cfg`` has experts (``cfg.moe_layers``; None: every layer)."""
    return bool(cfg.experts) and (cfg.moe_layers is None or i in cfg.moe_layers)


def init_mlp(cfg, w: Callable, out_std: float) -> dict:
    """The declarations of one MoE MLP; ``w(shape, dims, std)`` declares one weight."""
    E, H, F = cfg.experts, cfg.hidden, cfg.moe_mlp or cfg.mlp
    L = getattr(cfg, "moe_latent", 0) or H          # (Nemotron 3 Super: the experts on a latent width)
    p = {"router": w((H, E), "hidden experts"),
         "gate": w((E, L, F), "experts hidden mlp"),
         "up": w((E, L, F), "experts hidden mlp"),
         "down": w((E, F, L), "experts mlp hidden", out_std)}
    if L != H:
        p.update(latent_in=w((H, L), "hidden latent"), latent_out=w((L, H), "latent hidden", out_std))
    if not cfg.mlp_gated:                           # (Nemotron 3) experts not gated: down(act(up x))
        del p["gate"]
    if cfg.shared_expert_mlp:
        S = cfg.shared_expert_mlp
        p["shared_expert"] = {"gate_proj": w((H, S), "hidden mlp"), "up_proj": w((H, S), "hidden mlp"),
                              "down_proj": w((S, H), "mlp hidden", out_std)}
        if not cfg.mlp_gated:
            del p["shared_expert"]["gate_proj"]
        if cfg.shared_expert_gate:
            p["shared_expert_gate"] = w((H,), "hidden")
    if getattr(cfg, "router_bias", False):          # DeepSeek-V3's score correction: chooses, not trained
        p["router_bias"] = dataclasses.replace(w((E,), "experts"), init="zeros")
    if getattr(cfg, "moe_bias", False):              # (gpt-oss) biases start at zero
        p.update(_biases(cfg, w))
    if getattr(cfg, "experts_beside_mlp", False):    # (Gemma 4) the router's input scale, the weights' scales
        p["router_scale"] = dataclasses.replace(w((H,), "hidden"), init="ones")
        p["expert_scale"] = dataclasses.replace(w((E,), "experts"), init="ones")
    return p


def _biases(cfg, w: Callable) -> dict:
    """The router's bias and the experts' (gpt-oss), declared by ``w`` at zero."""
    E, H, F = cfg.experts, cfg.hidden, cfg.moe_mlp or cfg.mlp
    return {"router_logit_bias": w((E,), "experts", 0.0), "expert_gate_bias": w((E, F), "experts mlp", 0.0),
            "expert_up_bias": w((E, F), "experts mlp", 0.0), "expert_down_bias": w((E, H), "experts hidden", 0.0)}


def _prompt_padding(cfg) -> Named | None:
    """Sampling left-padded prompts: each row's padding, which takes no expert capacity (a
    row's slots are those it has alone; dropless routing needs none)."""
    cache = kv_cache.active() if cfg.capacity_factor is not None else None
    return None if cache is None else cache.prompt_padding()


def mlp_block(m: dict, h: Named, cfg, router_x: Named | None = None) -> Named:
    """The routed experts of ``h`` (batch seq hidden), plus the shared expert if any;
    the layer's router statistics go to the active :func:`collect`. ``router_x``: what the
    router scores (None: ``h``; Gemma 4: the residual stream, :func:`beside_mlp`)."""
    x = h
    if "latent_in" in m:                             # (Nemotron 3 Super) the experts on latent_in(h), named hidden
        x = ops.rename(ops.einsum("batch seq hidden, hidden latent -> batch seq latent", h, m["latent_in"]),
                       latent="hidden")
        router_x = h if router_x is None else router_x
    out, stats = experts(x, m["router"], m.get("gate"), m["up"], m["down"], top_k=cfg.experts_top_k,
                         normalize=cfg.norm_topk_prob, score=cfg.router_score,
                         capacity_factor=cfg.capacity_factor, bias=m.get("router_bias"), **_grouping(cfg),
                         router_logit_bias=m.get("router_logit_bias"),
                         expert_biases=(tuple(m[f"expert_{k}_bias"] for k in ("gate", "up", "down"))
                                        if "router_logit_bias" in m else None),
                         clamp=None if getattr(cfg, "swiglu_limit", None) is None else (cfg.swiglu_alpha, cfg.swiglu_limit),
                         weights_on_input=getattr(cfg, "experts_scale_input", False),
                         token_capacity=getattr(cfg, "token_capacity", None), router_x=router_x,
                         expert_scale=m.get("expert_scale"), activation=cfg.mlp_act,
                         row_padding=_prompt_padding(cfg))
    if "latent_out" in m:
        out = ops.einsum("batch seq latent, latent hidden -> batch seq hidden", ops.rename(out, hidden="latent"),
                         m["latent_out"])
    for found in _store.stack:
        found.append(stats)
    if "shared_expert" in m:
        s = m["shared_expert"]
        up = ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", h, s["up_proj"])
        if "gate_proj" in s:
            gate = ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", h, s["gate_proj"])
            act = ops.swiglu(gate, up)
        else:                                               # (Nemotron 3) not gated
            act = _ACTS[cfg.mlp_act](up)
        shared = ops.einsum("batch seq mlp, mlp hidden -> batch seq hidden", act, s["down_proj"])
        if "shared_expert_gate" not in m:                   # DeepSeek-V3, GLM-4.5: added as it is
            return out + shared
        g = ops.einsum("batch seq hidden, hidden -> batch seq", h, m["shared_expert_gate"])
        sigmoid = (ops.tanh(g * 0.5) + 1.0) * 0.5             # sigmoid(g), exactly as the identity
        out = out + shared * sigmoid
    return out


def beside_mlp(m: dict, x: Named, cfg, norm: Callable[[str, Named], Named]) -> Named:
    """Gemma 4's experts beside the dense MLP (``cfg.experts_beside_mlp``; 26B-A4B) of the
    residual stream ``x`` (batch seq hidden): the router scores a weightless RMSNorm of ``x`` times
    ``router_scale`` and ``hidden ** -0.5``; its renormalised top-k weights times ``expert_scale``
    weigh the experts of ``pre_feedforward_layernorm_2(x)``, whose sum is normed by
    ``post_feedforward_layernorm_2`` (returned along ``res_seq``, the residual stream's sequence);
    ``norm(name, value)`` applies the layer's norm ``name``."""
    dtype = x.data.dtype                               # (in float32 at least, as transformers)
    wide = ops.rms_norm(x.astype(torch.promote_types(dtype, torch.float32)), dim="hidden", eps=cfg.norm_eps).astype(dtype)
    scored = wide * m["router_scale"] * (cfg.hidden ** -0.5)
    out = mlp_block(m, norm("pre_feedforward_layernorm_2", x), cfg, router_x=scored)
    return norm("post_feedforward_layernorm_2", ops.rename(out, seq="res_seq"))


_ACTS = {"silu": ops.silu, "gelu_tanh": lambda x: ops.gelu(x, approximate="tanh"),
         "relu2": lambda x: ops.square(ops.relu(x))}
"""A shared expert's activation when not gated (the experts' :data:`~functional_pp.ops.experts.ACTIVATIONS`)."""


def _grouping(cfg) -> dict:
    """The grouped, scaled routing options of ``cfg`` (DeepSeek-V2/V3, GLM-4.5; defaults: none)."""
    return dict(groups=getattr(cfg, "router_groups", 1), topk_groups=getattr(cfg, "router_topk_groups", 1),
                group_score=getattr(cfg, "router_group_score", "top2_sum"),
                weight_scale=getattr(cfg, "routed_scaling_factor", 1.0))


@contextmanager
def collect() -> Iterator[list[RouterStats]]:
    """Collect the router statistics of the MoE layers run inside (this device's thread;
    nested collections each see them)."""
    stack = _store.stack
    found: list[RouterStats] = []
    stack.append(found)
    try:
        yield found
    finally:
        stack.pop()          # (nested collections end in order; no comparison: traceable)


def aux_loss(stats: list[RouterStats]) -> Named:
    """The load-balancing loss of a forward's MoE layers (:func:`functional_pp.ops.experts.load_balancing_loss`)."""
    return load_balancing_loss(stats)


def z_loss(stats: list[RouterStats]) -> Named:
    """The router z-loss of a forward's MoE layers (:func:`functional_pp.ops.experts.router_z_loss`)."""
    return router_z_loss(stats)


def router_losses(stats: list[RouterStats], cfg) -> Named | None:
    """What a forward's MoE layers add to the loss: ``router_aux_loss_coef`` times the
    load-balancing loss plus ``router_z_loss_coef`` times the z-loss (None: nothing), each
    reported to the step's metrics (``moe_aux_loss``, ``moe_z_loss``, unscaled) along with
    :func:`report_routing`."""
    if not stats:
        return None
    report_routing(stats)
    out = None
    for coef, fn, name in ((cfg.router_aux_loss_coef, aux_loss, "moe_aux_loss"),
                           (cfg.router_z_loss_coef, z_loss, "moe_z_loss")):
        if coef:
            value = fn(stats)
            step_values.report(name, value.data)
            out = value * coef if out is None else out + value * coef
    return out


def report_routing(stats: list[RouterStats]) -> None:
    """The routing of a forward's MoE layers in the step's metrics (when a step collects them;
    core/step_values.py), all global (every device's tokens), as device tensors read with the
    other metrics: ``moe_tokens_per_expert`` (the assignments per expert, summed over the
    layers and micro-batches), ``moe_load_balance`` (the busiest expert's assignments over the
    mean, the largest over the layers: 1 is balanced, ``experts / top_k`` all on one) and
    ``moe_dropped`` (the assignments dropped for want of capacity; 0 when dropless). One
    all-reduce of the layers' counts (no host read)."""
    if not step_values.active():
        return
    counts, dropped = routing_counts(stats)
    step_values.report("moe_tokens_per_expert", counts.sum(0), "sum")
    step_values.report("moe_load_balance", (counts.max(1).values / counts.mean(1).clamp_min(1e-30)).max())
    step_values.report("moe_dropped", dropped.sum(), "sum")
