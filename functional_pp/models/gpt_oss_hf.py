"""gpt-oss's ``config.json`` as :class:`~functional_pp.models.llama.Config` and back: Llama's
decoder with biased q/k/v/o projections, attention sinks (``attn_sinks``), sliding-window and
full layers alternating by ``layer_types``, YaRN rope, and in every layer experts with a biased
router, biased projections and the clamped SwiGLU (``moe_bias``, ``swiglu_limit`` /
``swiglu_alpha``; models/moe.py). Its tensors' names are in models/llama_hf.py (``RENAMED``,
``FUSED``: gate and up alternate in ``gate_up_proj``)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from functional_pp.models.llama import Config

__all__ = ["llama_dict", "read", "NEED", "as_llama", "write", "DEFAULTS"]

DEFAULTS: dict[str, Any] = dict(
    num_local_experts=128, num_experts_per_tok=4, sliding_window=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
    swiglu_alpha=1.702, swiglu_limit=7.0, router_aux_loss_coef=0.001, attention_bias=True, head_dim=64,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
"""``GptOssConfig``'s defaults of the keys read here (a config.json may leave them out)."""

# the fields a gpt-oss has, whatever its config.json
_FIXED = dict(attn_sinks=True, moe_bias=True, norm_topk_prob=True, router_score="softmax", moe_layers=None,
              moe_mlp=None, shared_expert_mlp=0, router_z_loss_coef=0.0)
NEED: dict[str, Any] = dict(_FIXED, qkv_bias=True, o_bias=True, capacity_factor=None)
"""The fields ``GptOssForCausalLM`` has one value of (export refuses others by name)."""


def _get(hf: dict, key: str) -> Any:
    v = hf.get(key)
    return DEFAULTS.get(key) if v is None else v


def _layer_types(layers: int) -> list[str]:
    """GptOssConfig's default: sliding layers first, every second layer full."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]


def llama_dict(hf: dict) -> dict:
    """The Llama ``config.json`` of a gpt-oss one's attention, norms and rope (read by Llama's
    reader); a ValueError names what gpt-oss's class cannot be."""
    if hf.get("attention_bias") is False:
        raise ValueError("HF gpt_oss config: attention_bias=False is not supported (gpt-oss's projections have "
                         "biases)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or DEFAULTS["rope_parameters"]
    rope = {"rope_theta": float(hf.get("rope_theta") or 150000.0), **rope}
    return dict(hf, model_type="llama", attention_bias=True, rope_parameters=rope, rope_scaling=None,
                head_dim=_get(hf, "head_dim"), rms_norm_eps=_get(hf, "rms_norm_eps"),
                max_position_embeddings=_get(hf, "max_position_embeddings"))


def read(hf: dict, layers: int) -> dict:
    """The Config fields of a gpt-oss ``config.json`` beyond Llama's (windows, experts)."""
    types = tuple(hf.get("layer_types") or _layer_types(layers))
    if sorted(set(types) - {"full_attention", "sliding_attention"}) or len(types) != layers:
        raise ValueError(f"HF gpt_oss config: layer_types {list(types)} must be {layers} entries of "
                         f"full_attention / sliding_attention")
    window = hf["sliding_window"] if "sliding_window" in hf else DEFAULTS["sliding_window"]
    sliding = window is not None and "sliding_attention" in types
    return dict(_FIXED, model_type="gpt_oss", sliding_window=int(window) if sliding else None,
                layer_types=(None if all(t == "sliding_attention" for t in types) else types) if sliding else None,
                experts=int(_get(hf, "num_local_experts")), experts_top_k=int(_get(hf, "num_experts_per_tok")),
                router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef")) if hf.get("output_router_logits") else 0.0,
                swiglu_limit=float(_get(hf, "swiglu_limit")), swiglu_alpha=float(_get(hf, "swiglu_alpha")))


def as_llama(cfg: Config) -> Config:
    """The Llama config of gpt-oss's attention and norms (what Llama's export writes the same);
    a ValueError names a gpt-oss config that ``GptOssForCausalLM`` cannot hold."""
    if cfg.experts < 1 or cfg.swiglu_limit is None:
        raise ValueError("export as 'gpt_oss': GptOssForCausalLM has experts (experts > 0) with the clamped "
                         "SwiGLU (swiglu_limit set)")
    return dataclasses.replace(cfg, model_type="llama", sliding_window=None, layer_types=None, experts=0,
                               moe_bias=False, swiglu_limit=None, attn_sinks=False, norm_topk_prob=False,
                               router_aux_loss_coef=0.0)


def write(cfg: Config, out: dict) -> None:
    """gpt-oss's keys into the Llama ``config.json`` of :func:`as_llama`."""
    for key in ("mlp_bias", "pretraining_tp"):
        out.pop(key, None)
    out.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True,
               num_local_experts=cfg.experts, num_experts_per_tok=cfg.experts_top_k,
               swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
               router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=bool(cfg.router_aux_loss_coef),
               sliding_window=cfg.sliding_window,
               layer_types=[("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.layers)])
