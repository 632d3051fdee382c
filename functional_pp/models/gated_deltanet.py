"""Gated DeltaNet, the token mixer of the "linear_attention" layers of Qwen3-Next and Qwen3.5
(``Config.layer_types``): q, k and v projected, each through a causal depthwise convolution and
SiLU, the gated delta rule over the whole sequence (``ops.linear_attention``: q and k
L2-normalised, beta = sigmoid(b), log decay g = -exp(A_log) softplus(a + dt_bias)), its output
RMS-normed over each value head (a weight of v_head_dim) times SiLU of a gate z, then projected
back to hidden.

Dimension names: the value heads are ``heads`` and the key heads ``kv_heads`` (tensor parallelism
splits them as it splits attention's), of ``head_dim`` (linear_key_head_dim) and ``v_head_dim``
(linear_value_head_dim) entries; the convolution's taps are ``kernel``. Tree (HF names in
models/llama_hf.py): ``linear_attn.{in_proj_q, in_proj_k, in_proj_v}`` (HF's fused
``in_proj_qkv``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv_q`` / ``conv_k`` / ``conv_v``
(HF's ``conv1d.weight``, split like ``in_proj_qkv``), ``dt_bias``, ``A_log``, ``norm``, ``out_proj``."""
from __future__ import annotations

import dataclasses
import math

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models import kv_cache
from functional_pp.ops.linear_attention import causal_conv1d, gated_delta_rule
from functional_pp.parallel.named import Named

KIND = "linear_attention"
"""The ``layer_types`` entry of a layer whose token mixer is Gated DeltaNet."""


def check_config(cfg) -> None:
    """Refuse linear-attention sizes that cannot work (before any parameter is made)."""
    for key in ("linear_heads", "linear_kv_heads", "linear_head_dim", "linear_v_head_dim", "linear_conv_kernel"):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a positive integer for layer_types' {KIND} layers, got {v!r}")
    if cfg.linear_heads % cfg.linear_kv_heads:
        raise ValueError(f"linear_heads={cfg.linear_heads} (linear_num_value_heads) must be a multiple of "
                         f"linear_kv_heads={cfg.linear_kv_heads} (linear_num_key_heads)")


def init_layer(cfg, w, out_std: float, dtype: torch.dtype) -> dict:
    """The parameter declarations of one Gated DeltaNet mixer (``w(shape, dims, scale)``: a normal
    initialiser; A_log uniform in [-log 16, log 16], so A in [1/16, 16] as transformers' uniform(0.01, 16)
    mostly is; dt_bias and the norm ones)."""
    H, Hk, Dk, Dv, K = (cfg.linear_heads, cfg.linear_kv_heads, cfg.linear_head_dim, cfg.linear_v_head_dim,
                        cfg.linear_conv_kernel)
    conv_std = 1.0 / math.sqrt(K)
    return {
        "in_proj_q": w((cfg.hidden, Hk, Dk), "hidden kv_heads head_dim"),
        "in_proj_k": w((cfg.hidden, Hk, Dk), "hidden kv_heads head_dim"),
        "in_proj_v": w((cfg.hidden, H, Dv), "hidden heads v_head_dim"),
        "in_proj_z": w((cfg.hidden, H, Dv), "hidden heads v_head_dim"),
        "in_proj_b": w((cfg.hidden, H), "hidden heads"),
        "in_proj_a": w((cfg.hidden, H), "hidden heads"),
        # (meta linear False: convolution taps, not a linear: no all-linear LoRA target, as peft's nn.Conv1d)
        "conv_q": dataclasses.replace(w((Hk, Dk, K), "kv_heads head_dim kernel", conv_std), meta={"linear": False}),
        "conv_k": dataclasses.replace(w((Hk, Dk, K), "kv_heads head_dim kernel", conv_std), meta={"linear": False}),
        "conv_v": dataclasses.replace(w((H, Dv, K), "heads v_head_dim kernel", conv_std), meta={"linear": False}),
        "dt_bias": param((H,), "heads", init="ones", dtype=dtype),
        "A_log": param((H,), "heads", init="uniform", scale=math.log(16.0), dtype=dtype),
        "norm": param((Dv,), "v_head_dim", init="ones", dtype=dtype),
        "out_proj": dataclasses.replace(w((H, Dv, cfg.hidden), "heads v_head_dim hidden", out_std),
                                        meta={"in_dims": 2}),
    }


def _softplus(t: torch.Tensor) -> torch.Tensor:
    """torch's softplus (beta 1, threshold 20) from log1p and exp: the fused kernel's backward gives a
    block whose strides a compiled step's views do not expect."""
    return torch.where(t > 20, t, torch.log1p(torch.exp(t.clamp(max=20))))


def _conv_silu(x: Named, weight: Named, segments: Named | None) -> Named:
    return ops.silu(causal_conv1d(x, weight, seq="seq", kernel="kernel", segments=segments))


def mixer(a: dict, h: Named, cfg, segments: Named | None = None) -> Named:
    """Gated DeltaNet of the normed input ``h`` (batch seq hidden, the sequence whole); the output
    batch seq hidden (before the residual's layout). ``segments`` (packed documents): each document
    runs as if alone (no convolution tap or state crosses into the next)."""
    if kv_cache.active() is not None:
        raise ValueError(f"sampling with a key / value cache does not support {KIND} (Gated DeltaNet) layers: they "
                         f"need a recurrent state cache, not built yet")

    def proj(name: str, out: str) -> Named:
        return ops.einsum(f"batch seq hidden, hidden {out} -> batch seq {out}", h, a[name])
    q, k = proj("in_proj_q", "kv_heads head_dim"), proj("in_proj_k", "kv_heads head_dim")
    v, z = proj("in_proj_v", "heads v_head_dim"), proj("in_proj_z", "heads v_head_dim")
    b, dt = proj("in_proj_b", "heads"), proj("in_proj_a", "heads")
    q, k, v = (_conv_silu(t, a[f"conv_{x}"], segments) for t, x in ((q, "q"), (k, "k"), (v, "v")))
    beta = (ops.tanh(b * 0.5) + 1.0) * 0.5                          # sigmoid(b)
    wide = torch.float32 if dt.data.dtype in (torch.float16, torch.bfloat16) else dt.data.dtype
    decay = (dt.astype(wide) + a["dt_bias"].astype(wide)).map(_softplus) * -ops.exp(a["A_log"].astype(wide))
    o = gated_delta_rule(q, k, v, decay, beta, batch="batch", seq="seq", heads="heads", kv_heads="kv_heads",
                         head_dim="head_dim", v_head_dim="v_head_dim", segments=segments)
    o = ops.rms_norm(o, a["norm"], dim="v_head_dim", eps=cfg.norm_eps) * ops.silu(z)
    return ops.einsum("batch seq heads v_head_dim, heads v_head_dim hidden -> batch seq hidden", o, a["out_proj"])


def flops(cfg, seq: int) -> float:
    """Forward FLOPs per token of one mixer: the projections and the rule's chunked matmuls (64-wide chunks)."""
    H, Hk, Dk, Dv = cfg.linear_heads, cfg.linear_kv_heads, cfg.linear_head_dim, cfg.linear_v_head_dim
    proj = 2 * cfg.hidden * (2 * Hk * Dk + 2 * H * Dv + 2 * H) + 2 * H * Dv * cfg.hidden
    c = min(64, seq)
    rule = 2 * H * (c * (2 * Dk + 2 * Dv) + 3 * Dk * Dv)
    return proj + rule
