"""Kimi Delta Attention (KDA), the token mixer of Kimi Linear's linear-attention layers
(``Config.layer_types`` "kimi_delta_attention"; transformers' ``KimiLinearDeltaAttention``): Gated
DeltaNet (models/gated_deltanet.py) whose decay is one per key channel, not one per head. q, k and
v projected, each through a causal depthwise convolution and SiLU; the log decay
g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias) per head and key channel (a low-rank projection of
rank head_dim); beta = sigmoid(b_proj(x)); the gated delta rule (``ops.linear_attention``, its
per-channel form; q and k L2-normalised) over the whole sequence; its output RMS-normed over each
head times sigmoid of a low-rank gate g_b(g_a(x)), then projected back to hidden.

Every head has its own q, k and v (``heads`` of ``head_dim`` entries; v's named ``v_head_dim``, of
the same size): tensor parallelism splits the heads, the convolution's channels and the per-channel
decay with them; the low-rank ``gate_rank`` stays whole. Tree (HF names in models/kimi_linear_hf.py):
``kda.{q_proj, k_proj, v_proj}``, ``conv_q`` / ``conv_k`` / ``conv_v`` (HF's ``q_conv1d`` ...),
``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log``, ``b_proj``, ``g_a_proj``, ``g_b_proj``,
``o_norm``, ``o_proj``."""
from __future__ import annotations

import dataclasses
import math

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models import kv_cache
from functional_pp.models.gated_deltanet import _conv_silu, _softplus
from functional_pp.ops.linear_attention import gated_delta_rule
from functional_pp.parallel.named import Named

KIND = "kimi_delta_attention"
"""The ``layer_types`` entry of a layer whose token mixer is Kimi Delta Attention."""


def check_config(cfg) -> None:
    """Refuse KDA sizes that cannot work (before any parameter is made)."""
    for key in ("linear_heads", "linear_head_dim", "linear_conv_kernel"):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a positive integer for layer_types' {KIND} layers, got {v!r}")


def init_layer(cfg, w, out_std: float, dtype: torch.dtype) -> dict:
    """The parameter declarations of one KDA mixer (``w(shape, dims, scale)``: a normal initialiser;
    A_log uniform in [-log 16, log 16], dt_bias and the norm ones)."""
    H, D, K = cfg.linear_heads, cfg.linear_head_dim, cfg.linear_conv_kernel
    conv_std = 1.0 / math.sqrt(K)
    return {
        "q_proj": w((cfg.hidden, H, D), "hidden heads head_dim"),
        "k_proj": w((cfg.hidden, H, D), "hidden heads head_dim"),
        "v_proj": w((cfg.hidden, H, D), "hidden heads v_head_dim"),
        # (meta linear False: convolution taps and a bias, not linears: no all-linear LoRA target, as peft's)
        "conv_q": dataclasses.replace(w((H, D, K), "heads head_dim kernel", conv_std), meta={"linear": False}),
        "conv_k": dataclasses.replace(w((H, D, K), "heads head_dim kernel", conv_std), meta={"linear": False}),
        "conv_v": dataclasses.replace(w((H, D, K), "heads v_head_dim kernel", conv_std), meta={"linear": False}),
        "f_a_proj": w((cfg.hidden, D), "hidden gate_rank"),
        "f_b_proj": w((D, H, D), "gate_rank heads head_dim"),
        "dt_bias": dataclasses.replace(param((H, D), "heads head_dim", init="ones", dtype=dtype), meta={"linear": False}),
        "A_log": param((H,), "heads", init="uniform", scale=math.log(16.0), dtype=dtype),
        "b_proj": w((cfg.hidden, H), "hidden heads"),
        "g_a_proj": w((cfg.hidden, D), "hidden gate_rank"),
        "g_b_proj": w((D, H, D), "gate_rank heads v_head_dim"),
        "o_norm": param((D,), "v_head_dim", init="ones", dtype=dtype),
        "o_proj": dataclasses.replace(w((H, D, cfg.hidden), "heads v_head_dim hidden", out_std), meta={"in_dims": 2}),
    }


def mixer(a: dict, h: Named, cfg, segments: Named | None = None) -> Named:
    """KDA of the normed input ``h`` (batch seq hidden, the sequence whole) -> batch seq hidden (before
    the residual's layout). ``segments`` (packed documents): each document runs as if alone."""
    if kv_cache.active() is not None:
        raise ValueError(f"sampling with a key / value cache does not support {KIND} (Kimi Delta Attention) layers: "
                         f"they need a recurrent state cache, not built yet")

    def proj(x: Named, name: str, out: str, inp: str = "hidden") -> Named:
        return ops.einsum(f"batch seq {inp}, {inp} {out} -> batch seq {out}", x, a[name])
    q, k = proj(h, "q_proj", "heads head_dim"), proj(h, "k_proj", "heads head_dim")
    v = proj(h, "v_proj", "heads v_head_dim")
    q, k, v = (_conv_silu(t, a[f"conv_{x}"], segments) for t, x in ((q, "q"), (k, "k"), (v, "v")))
    f = proj(proj(h, "f_a_proj", "gate_rank"), "f_b_proj", "heads head_dim", "gate_rank")
    wide = torch.float32 if f.data.dtype in (torch.float16, torch.bfloat16) else f.data.dtype
    decay = (f.astype(wide) + a["dt_bias"].astype(wide)).map(_softplus) * -ops.exp(a["A_log"].astype(wide))
    b = proj(h, "b_proj", "heads")
    beta = (ops.tanh(b * 0.5) + 1.0) * 0.5                          # sigmoid(b)
    o = gated_delta_rule(q, k, v, decay, beta, batch="batch", seq="seq", heads="heads", kv_heads="heads",
                         head_dim="head_dim", v_head_dim="v_head_dim", segments=segments)
    gate = proj(proj(h, "g_a_proj", "gate_rank"), "g_b_proj", "heads v_head_dim", "gate_rank")
    o = ops.rms_norm(o, a["o_norm"], dim="v_head_dim", eps=cfg.norm_eps) * ((ops.tanh(gate * 0.5) + 1.0) * 0.5)
    return ops.einsum("batch seq heads v_head_dim, heads v_head_dim hidden -> batch seq hidden", o, a["o_proj"])


def flops(cfg, seq: int) -> float:
    """Forward FLOPs per token of one mixer: the projections and the rule's chunked products (64-wide
    chunks; the per-channel decay makes each score a sum over the channels of decayed products)."""
    H, D = cfg.linear_heads, cfg.linear_head_dim
    proj = 2 * cfg.hidden * (3 * H * D + 2 * D + H) + 2 * 2 * D * H * D + 2 * H * D * cfg.hidden
    c = min(64, seq)
    rule = 2 * H * (c * (4 * D + 2 * D) + 3 * D * D)
    return proj + rule
