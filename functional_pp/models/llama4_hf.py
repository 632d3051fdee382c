"""Llama 4's text ``config.json`` (``llama4_text``) as :class:`~functional_pp.models.llama.Config`
and back: Llama's decoder with the interleaved rotary (complex pairs), NoPE layers
(``no_rope_layers`` 0s) with attention temperature tuning, chunked attention in the rotating
layers (``attention_chunk``), a weightless q/k RMSNorm there (``qk_l2_norm``), and experts in
every ``interleave_moe_layer_step``-th layer: a shared expert added as it is and routed experts
chosen by the top-k router logits, each sigmoid weighting the expert's input
(``experts_scale_input``); the dense layers' MLP is ``intermediate_size_mlp`` wide. Its tensors'
names are in models/llama_hf.py (``RENAMED``: ``feed_forward``; ``FUSED``: gate and up halves of
``gate_up_proj``)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from functional_pp.models.llama import Config

__all__ = ["llama_dict", "read", "NEED", "as_llama", "write", "DEFAULTS"]

DEFAULTS: dict[str, Any] = dict(
    intermediate_size=8192, intermediate_size_mlp=16384, head_dim=128, rms_norm_eps=1e-5,
    max_position_embeddings=4096 * 32, num_experts_per_tok=1, num_local_experts=16, interleave_moe_layer_step=1,
    use_qk_norm=True, router_aux_loss_coef=0.001, no_rope_layer_interval=4, attention_chunk_size=8192,
    attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, rope_theta=500000.0)
"""``Llama4TextConfig``'s defaults of the keys read here (a config.json may leave them out)."""

_FIXED = dict(rotary_interleaved=True, router_score="sigmoid", norm_topk_prob=False, shared_expert_gate=False,
              experts_scale_input=True, router_z_loss_coef=0.0)
NEED: dict[str, Any] = dict(_FIXED, capacity_factor=None, sliding_window=None, attn_temperature_offset=1.0,
                            attn_temperature_all_layers=False)
"""The fields ``Llama4ForCausalLM`` has one value of (export refuses others by name)."""


def _get(hf: dict, key: str) -> Any:
    v = hf.get(key)
    return DEFAULTS.get(key) if v is None else v


def llama_dict(hf: dict) -> dict:
    """The Llama ``config.json`` of a Llama 4 text one's attention, norms and rope (read by
    Llama's reader); a ValueError names what the functional decoder does not do."""
    if float(hf.get("router_jitter_noise") or 0.0):
        raise ValueError(f"HF llama4_text config: router_jitter_noise={hf['router_jitter_noise']!r} is not supported "
                         f"(a deterministic router only; set it to 0.0)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {"rope_type": "default"}
    rope = {"rope_theta": float(hf.get("rope_theta") or DEFAULTS["rope_theta"]), **rope}
    return dict(hf, model_type="llama", rope_parameters=rope, rope_scaling=None, head_dim=_get(hf, "head_dim"),
                intermediate_size=_get(hf, "intermediate_size_mlp"), rms_norm_eps=_get(hf, "rms_norm_eps"),
                max_position_embeddings=_get(hf, "max_position_embeddings"))


def read(hf: dict, layers: int) -> dict:
    """The Config fields of a Llama 4 text ``config.json`` beyond Llama's."""
    interval = int(_get(hf, "no_rope_layer_interval"))
    rope_layers = list(hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)])
    chunk = hf["attention_chunk_size"] if "attention_chunk_size" in hf else DEFAULTS["attention_chunk_size"]
    types = list(hf.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                           for r in rope_layers])
    if len(rope_layers) != layers or len(types) != layers or set(types) - {"full_attention", "chunked_attention"}:
        raise ValueError(f"HF llama4_text config: no_rope_layers {rope_layers} and layer_types {types} must be "
                         f"{layers} entries (layer types full_attention / chunked_attention)")
    step = int(_get(hf, "interleave_moe_layer_step"))
    moe = tuple(hf.get("moe_layers") if hf.get("moe_layers") is not None else range(step - 1, layers, step))
    chunked = chunk is not None and "chunked_attention" in types
    nope = tuple(i for i, r in enumerate(rope_layers) if not r)
    return dict(_FIXED, model_type="llama4_text", attention_chunk=int(chunk) if chunked else None,
                layer_types=tuple(types) if chunked else None, nope_layers=nope or None,
                qk_l2_norm=bool(_get(hf, "use_qk_norm")),
                attn_temperature_floor=float(_get(hf, "floor_scale")) if _get(hf, "attn_temperature_tuning") else None,
                attn_temperature_scale=float(_get(hf, "attn_scale")),
                experts=int(_get(hf, "num_local_experts")) if moe else 0,
                experts_top_k=int(_get(hf, "num_experts_per_tok")),
                moe_mlp=int(_get(hf, "intermediate_size")), shared_expert_mlp=int(_get(hf, "intermediate_size")),
                moe_layers=None if len(moe) == layers else moe,
                router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef")) if hf.get("output_router_logits") else 0.0)


def as_llama(cfg: Config) -> Config:
    """The Llama config of Llama 4's attention and norms (what Llama's export writes the same)."""
    if cfg.moe_mlp is None or cfg.shared_expert_mlp != cfg.moe_mlp:
        raise ValueError(f"export as 'llama4_text': Llama4ForCausalLM's shared expert is as wide as each expert "
                         f"(moe_mlp={cfg.moe_mlp}, shared_expert_mlp={cfg.shared_expert_mlp})")
    return dataclasses.replace(cfg, model_type="llama", rotary_interleaved=False, nope_layers=None, layer_types=None,
                               attention_chunk=None, qk_l2_norm=False, attn_temperature_floor=None, experts=0,
                               moe_mlp=None, shared_expert_mlp=0, moe_layers=None, router_score="softmax",
                               shared_expert_gate=True, experts_scale_input=False, router_aux_loss_coef=0.0,
                               experts_linearized=False)


def write(cfg: Config, out: dict) -> None:
    """Llama 4's keys into the Llama ``config.json`` of :func:`as_llama`."""
    for key in ("mlp_bias", "pretraining_tp"):
        out.pop(key, None)
    moe = [i for i in range(cfg.layers) if cfg.experts and (cfg.moe_layers is None or i in cfg.moe_layers)]
    out.update(architectures=["Llama4ForCausalLM"], model_type="llama4_text", intermediate_size_mlp=cfg.mlp,
               intermediate_size=cfg.moe_mlp, num_local_experts=cfg.experts, num_experts_per_tok=cfg.experts_top_k,
               moe_layers=moe, interleave_moe_layer_step=1, use_qk_norm=cfg.qk_l2_norm,
               no_rope_layers=[int(cfg.rotates(i)) for i in range(cfg.layers)],
               attention_chunk_size=cfg.attention_chunk,
               layer_types=[("chunked_attention" if cfg.chunk(i) else "full_attention") for i in range(cfg.layers)],
               attn_temperature_tuning=cfg.attn_temperature_floor is not None,
               floor_scale=cfg.attn_temperature_floor or DEFAULTS["floor_scale"], attn_scale=cfg.attn_temperature_scale,
               router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=bool(cfg.router_aux_loss_coef),
               router_jitter_noise=0.0)
    if float(out["floor_scale"]).is_integer():
        out["floor_scale"] = int(out["floor_scale"])
