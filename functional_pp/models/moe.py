"""The mixture-of-experts MLP of the decoder (Mixtral, Qwen3-MoE, Qwen2-MoE; docs/experts.md):
its parameter declarations, the block that replaces the dense MLP in the layers that have
experts, and the collection of every layer's router statistics for the auxiliary
load-balancing loss.

Parameters of one MoE MLP (``E`` experts of intermediate size ``F``, hidden ``H``):

    router        [H, E]     hidden experts       (HF ``mlp.gate.weight`` [E, H])
    gate, up      [E, H, F]  experts hidden mlp   (HF ``mlp.experts.{j}.gate_proj/up_proj.weight`` [F, H])
    down          [E, F, H]  experts mlp hidden   (HF ``mlp.experts.{j}.down_proj.weight`` [H, F])

and with a shared expert (Qwen2-MoE) ``shared_expert.{gate_proj, up_proj, down_proj}`` (a dense
MLP, ``hidden mlp``) and ``shared_expert_gate`` [H] (its sigmoid gate). ``experts`` is the
dimension that a rule splits for expert parallelism (``Rules(experts="ep")``)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from functional_pp import ops
from functional_pp.core.runtime import per_thread
from functional_pp.ops.experts import RouterStats, experts, load_balancing_loss
from functional_pp.parallel.named import Named

__all__ = ["init_mlp", "mlp_block", "collect", "aux_loss", "is_moe_layer"]

_store = per_thread("models.moe")


def is_moe_layer(cfg, i: int) -> bool:
    """Whether layer ``i`` of ``cfg`` has experts (``cfg.moe_layers``; None: every layer)."""
    return bool(cfg.experts) and (cfg.moe_layers is None or i in cfg.moe_layers)


def init_mlp(cfg, w: Callable, out_std: float) -> dict:
    """The declarations of one MoE MLP; ``w(shape, dims, std)`` declares one weight."""
    E, H, F = cfg.experts, cfg.hidden, cfg.moe_mlp or cfg.mlp
    p = {"router": w((H, E), "hidden experts"),
         "gate": w((E, H, F), "experts hidden mlp"),
         "up": w((E, H, F), "experts hidden mlp"),
         "down": w((E, F, H), "experts mlp hidden", out_std)}
    if cfg.shared_expert_mlp:
        S = cfg.shared_expert_mlp
        p["shared_expert"] = {"gate_proj": w((H, S), "hidden mlp"), "up_proj": w((H, S), "hidden mlp"),
                              "down_proj": w((S, H), "mlp hidden", out_std)}
        p["shared_expert_gate"] = w((H,), "hidden")
    return p


def mlp_block(m: dict, h: Named, cfg) -> Named:
    """The routed experts of ``h`` (batch seq hidden), plus the gated shared expert if any;
    the layer's router statistics go to the active :func:`collect`."""
    out, stats = experts(h, m["router"], m["gate"], m["up"], m["down"], top_k=cfg.experts_top_k,
                         normalize=cfg.norm_topk_prob, score=cfg.router_score)
    for found in getattr(_store, "stack", ()):
        found.append(stats)
    if "shared_expert" in m:
        s = m["shared_expert"]
        gate = ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", h, s["gate_proj"])
        up = ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", h, s["up_proj"])
        shared = ops.einsum("batch seq mlp, mlp hidden -> batch seq hidden", ops.swiglu(gate, up), s["down_proj"])
        g = ops.einsum("batch seq hidden, hidden -> batch seq", h, m["shared_expert_gate"])
        sigmoid = (ops.tanh(g * 0.5) + 1.0) * 0.5             # sigmoid(g), exactly as the identity
        out = out + shared * sigmoid
    return out


@contextmanager
def collect() -> Iterator[list[RouterStats]]:
    """Collect the router statistics of the MoE layers run inside (this device's thread;
    nested collections each see them)."""
    stack = getattr(_store, "stack", None)
    if stack is None:
        stack = _store.stack = []
    found: list[RouterStats] = []
    stack.append(found)
    try:
        yield found
    finally:
        stack.remove(found)


def aux_loss(stats: list[RouterStats]) -> Named:
    """The load-balancing loss of a forward's MoE layers (:func:`functional_pp.ops.experts.load_balancing_loss`)."""
    return load_balancing_loss(stats)
