"""NVIDIA's Nemotron-H (``nemotron_h``: ``NemotronHForCausalLM``) as a configuration of the one
decoder (docs/models.md, "Decoder families"): layers of one block each (``layer_blocks``), a
Mamba2 mixer (``M`` in ``hybrid_override_pattern``, ``linear_attention`` in ``layers_block_type``;
models/mamba2.py), attention without a rotary (``*``, ``full_attention``: every layer a NoPE
layer), a squared-ReLU MLP not gated (``-``, ``mlp``) or Nemotron 3's mixture of experts (``E``,
``moe``: an ``mlp`` block of ``Config.moe_layers``, models/moe.py: squared-ReLU experts not gated,
DeepSeek-V3's sigmoid router with its score correction and groups, a squared-ReLU shared expert),
each after an RMSNorm; the files under ``backbone.`` (``embeddings``, ``layers.{i}.norm``,
``layers.{i}.mixer``, ``norm_f``; the experts one tensor each, ``mixer.experts.{j}.up_proj``; Nemotron
3 Super's latent experts, ``moe_latent_size``: ``mixer.fc1_latent_proj`` / ``fc2_latent_proj``).
``residual_in_fp32`` is refused by name.

``config.json`` <-> :class:`~functional_pp.models.llama.Config` (:func:`config_from_hf`,
:func:`config_to_hf`, :func:`check_exportable`); the tensor names are the table's with :data:`RENAMED`."""
from __future__ import annotations

import math
from typing import Any

import torch

from functional_pp.models.llama import Config

__all__ = ["ARCHITECTURES", "DEFAULTS", "RENAMED", "MODULE_NAMES", "IGNORED", "config_from_hf", "config_to_hf",
           "check_exportable"]

ARCHITECTURES: dict[str, str] = {"nemotron_h": "NemotronHForCausalLM"}

RENAMED: tuple[tuple[str, str], ...] = (
    (r"^model\.embed_tokens\.", "backbone.embeddings."), (r"^model\.norm\.", "backbone.norm_f."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"backbone.layers.\1.norm."),
    (r"^model\.layers\.(\d+)\.(self_attn|mlp|mamba)\.", r"backbone.layers.\1.mixer."),
    (r"\.mixer\.shared_expert\.", ".mixer.shared_experts."))
"""Nemotron-H's tensor names beside the table's: one norm and one mixer per layer, under ``backbone.``."""

MODULE_NAMES: tuple[tuple[str, str], ...] = ((r"^backbone\.", "model."),)
"""The files' ``backbone.`` is ``model.`` in transformers' model (its modules, peft's adapter names)."""

IGNORED: tuple[str, ...] = (r"(backbone\.)?mtp\..*",)
"""The multi-token-prediction layers' tensors (unread, as by transformers)."""

BLOCKS = {"linear_attention": "mamba2", "full_attention": "attention", "mlp": "mlp", "moe": "mlp"}
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}

DEFAULTS: dict[str, Any] = dict(
    vocab_size=131072, hidden_size=4096, tie_word_embeddings=False, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=4096, attention_bias=False, attention_dropout=0.0, sliding_window=None,
    intermediate_size=21504, mlp_hidden_act="relu2", mlp_bias=False, ssm_state_size=128, mamba_num_heads=128,
    mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8, conv_kernel=4, time_step_limit=(0.0, math.inf),
    use_conv_bias=True, chunk_size=128, mamba_proj_bias=False, use_bias=False, initializer_range=0.02,
    layer_norm_epsilon=1e-5, residual_in_fp32=False, hidden_dropout=0.0, num_nextn_predict_layers=0,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, moe_latent_size=None)
"""``NemotronHConfig``'s defaults of the keys read here (a config.json may leave them out)."""

LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
          "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}
"""Older key names ``NemotronHConfig`` still reads."""


def _float(v: Any) -> float:
    """A number of config.json, transformers' ``{"__float__": "Infinity"}`` included."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def layer_types(hf: dict) -> list[str]:
    """Each layer's type: ``layers_block_type``, else ``hybrid_override_pattern``'s characters, else
    ``NemotronHConfig``'s default (Mamba2, MoE, attention, MLP)."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types:
        return list(types)
    pattern = hf.get("hybrid_override_pattern") or "ME*-"
    bad = sorted(set(pattern) - set(PATTERN))
    if bad:
        raise ValueError(f"HF nemotron_h config: hybrid_override_pattern {pattern!r} has characters {bad}; known: "
                         f"{', '.join(PATTERN)}")
    return [PATTERN[c] for c in pattern]


def config_from_hf(hf: dict, mt: str) -> Config:
    """``Config`` of a ``nemotron_h`` ``config.json``; a ValueError names what the decoder cannot reproduce."""
    where = f"HF {mt} config"
    hf = {LEGACY.get(k, k): v for k, v in hf.items()}

    def get(key: str) -> Any:
        v = hf.get(key)
        return DEFAULTS.get(key) if v is None else v
    types = layer_types(hf)
    bad = sorted(set(types) - set(BLOCKS))
    if bad:
        raise ValueError(f"{where}: layer types {bad} are not known; known: {', '.join(BLOCKS)}")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"), ("attention_bias", False),
                      ("use_bias", False), ("mamba_proj_bias", False), ("residual_in_fp32", False),
                      ("sliding_window", None)):
        if get(key) != want:
            raise ValueError(f"{where}: {key}={get(key)!r} is not supported (only {want!r})")
    for key in ("attention_dropout", "hidden_dropout"):
        if float(get(key) or 0.0):
            raise ValueError(f"{where}: {key}={get(key)!r} is not supported (set it to 0.0)")
    heads, hidden = int(get("num_attention_heads")), int(get("hidden_size"))
    kv = get("num_key_value_heads")
    lo, hi = (_float(v) for v in get("time_step_limit"))
    return Config(**_experts(types, get, where),
        model_type=mt, vocab=int(get("vocab_size")), hidden=hidden, layers=len(types), heads=heads,
        kv_heads=int(kv) if kv is not None else heads, mlp=int(get("intermediate_size")),
        head_dim=int(get("head_dim") or hidden // heads), rope_scaling=None, norm_eps=float(get("layer_norm_epsilon")),
        tie_embeddings=bool(get("tie_word_embeddings")), init_std=float(get("initializer_range")),
        max_seq=int(get("max_position_embeddings")), nope_layers=tuple(range(len(types))), mlp_gated=False,
        mlp_act="relu2", mlp_bias=bool(get("mlp_bias")), layer_blocks=tuple(BLOCKS[t] for t in types),
        mamba_heads=int(get("mamba_num_heads")), mamba_head_dim=int(get("mamba_head_dim")),
        mamba_groups=int(get("n_groups")), ssm_state=int(get("ssm_state_size")), conv_kernel=int(get("conv_kernel")),
        mamba_chunk=int(get("chunk_size")), mamba_dt_limit=None if (lo, hi) == (0.0, math.inf) else (lo, hi),
        mamba_conv_bias=bool(get("use_conv_bias")))


def _experts(types: list[str], get: Any, where: str) -> dict[str, Any]:
    """The Config fields of the ``moe`` layers (none: no experts)."""
    moe = tuple(i for i, t in enumerate(types) if t == "moe")
    if not moe:
        return {}
    return dict(moe_layers=moe, experts=int(get("n_routed_experts")), experts_top_k=int(get("num_experts_per_tok")),
                moe_mlp=int(get("moe_intermediate_size")),
                shared_expert_mlp=int(get("moe_shared_expert_intermediate_size")), shared_expert_gate=False,
                router_score="sigmoid", router_bias=True, norm_topk_prob=bool(get("norm_topk_prob")),
                router_groups=int(get("n_group") or 1), router_topk_groups=int(get("topk_group") or 1),
                router_group_score="top2_sum", routed_scaling_factor=float(get("routed_scaling_factor")),
                moe_latent=int(get("moe_latent_size") or 0))


def check_exportable(cfg: Config, plain: dict[str, Any], error: type = ValueError) -> None:
    """Refuse (``error``, naming the field) a config ``NemotronHForCausalLM`` cannot hold; ``plain``: the
    switches' values in Llama."""
    where, arch = f"export as {cfg.model_type!r}", ARCHITECTURES["nemotron_h"]
    need = {**plain, "nope_layers": tuple(range(cfg.layers)), "mlp_gated": False, "mlp_act": "relu2",
            "qkv_bias": False, "o_bias": False, "qk_norm": False, "norm_offset": 0.0, "scale_embeddings": False,
            "query_pre_attn_scalar": None, "attn_softcap": None, "final_softcap": None, "sliding_window": None,
            "mamba_proj_bias": False, "mlp_bias": cfg.mlp_bias}
    need.pop("layer_blocks"), need.pop("mamba_heads")
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs {want!r}); choose "
                        f"another model_type")
    blocks = cfg.layer_blocks or ("attention+mlp",) * cfg.layers
    bad = sorted(set(blocks) - {"mamba2", "attention", "mlp"})
    if bad:
        raise error(f"{where}: layer_blocks entries {bad} have no {arch} equivalent (its layers are one block each: "
                    f"mamba2, attention or mlp)")
    if not cfg.experts:
        return
    experts = {"router_score": "sigmoid", "router_bias": True, "shared_expert_gate": False,
               "router_group_score": "top2_sum", "moe_bias": False, "swiglu_limit": None, "capacity_factor": None,
               "experts_beside_mlp": False, "experts_scale_input": False}
    for key, want in experts.items():
        if getattr(cfg, key) != want:
            raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (its experts need {want!r})")
    if not cfg.shared_expert_mlp or cfg.moe_layers is None \
            or any(blocks[i] != "mlp" for i in cfg.moe_layers):
        raise error(f"{where}: shared_expert_mlp={cfg.shared_expert_mlp}, moe_layers={cfg.moe_layers}: {arch}'s "
                    f"experts need a shared expert and moe_layers naming layers whose layer_blocks entry is 'mlp'")


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """The ``NemotronHForCausalLM`` ``config.json`` of ``cfg`` (checked by :func:`check_exportable` before)."""
    dname = str(dtype).removeprefix("torch.")
    names = {v: k for k, v in BLOCKS.items() if k != "moe"}
    kinds = [("moe" if cfg.experts and i in (cfg.moe_layers or ()) else names[b]) for i, b in enumerate(cfg.layer_blocks)]
    m = cfg.mamba
    limit = list(cfg.mamba_dt_limit) if cfg.mamba_dt_limit is not None else [0.0, math.inf]
    out = {"architectures": [ARCHITECTURES["nemotron_h"]], "model_type": "nemotron_h", "vocab_size": cfg.vocab,
           "hidden_size": cfg.hidden, "layers_block_type": kinds,
           "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_head,
           "intermediate_size": cfg.mlp, "mlp_hidden_act": "relu2", "mlp_bias": cfg.mlp_bias,
           "max_position_embeddings": cfg.max_seq, "initializer_range": cfg.init_std,
           "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
           "use_bias": False, "mamba_proj_bias": False, "residual_in_fp32": False, "num_nextn_predict_layers": 0,
           "dtype": dname, "torch_dtype": dname}
    if m is not None:
        out.update(mamba_num_heads=m.heads, mamba_head_dim=m.head_dim, n_groups=m.groups, ssm_state_size=m.state,
                   conv_kernel=m.conv_kernel, chunk_size=m.chunk, use_conv_bias=m.conv_bias,
                   time_step_limit=[v if math.isfinite(v) else {"__float__": "Infinity"} for v in limit],
                   mamba_hidden_act="silu")
    if cfg.experts:
        out.update(n_routed_experts=cfg.experts, num_experts_per_tok=cfg.experts_top_k, moe_intermediate_size=cfg.moe_mlp
                   or cfg.mlp, moe_shared_expert_intermediate_size=cfg.shared_expert_mlp, n_group=cfg.router_groups,
                   topk_group=cfg.router_topk_groups, norm_topk_prob=cfg.norm_topk_prob,
                   routed_scaling_factor=cfg.routed_scaling_factor, moe_latent_size=cfg.moe_latent or None)
    return out
