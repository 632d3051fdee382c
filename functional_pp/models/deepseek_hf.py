"""The Hugging Face families built on DeepSeek's mixture of experts, as configuration of the one
decoder (docs/models.md, "Decoder families"): DeepSeek-V2 and DeepSeek-V3 (multi-head latent
attention, models/mla.py; shared + routed experts, dense layers first), GLM-4.5 (``glm4_moe``:
Llama-style attention with partial rotary, q/k/v biases and optional q/k norms) and GLM-4.7-Flash
(``glm4_moe_lite``: DeepSeek-V3's layer) and Mistral Small 4 (``mistral4``: DeepSeek-V3's layer
with every layer's queries scaled by position, Ministral 3's ``llama_4_scaling_beta``, and a
softmax router with grouped top-k; its files hold the experts as transformers does, gate and up
fused in ``experts.gate_up_proj``). Their routers: DeepSeek-V2's softmax (``topk_method``
greedy or group_limited_greedy), the others' sigmoid with a score correction
(``e_score_correction_bias``) and grouped top-k (``n_group``, ``topk_group``); the top-k weights
renormalised (``norm_topk_prob``) and scaled (``routed_scaling_factor``).

``config.json`` <-> :class:`~functional_pp.models.llama.Config` (:func:`config_from_hf`,
:func:`config_to_hf`, :func:`check_exportable`); the tensor names are
:data:`functional_pp.models.llama_hf.LLAMA_TABLE`'s (the latent attention's and the router's score
correction are rows of it; the shared expert is ``mlp.shared_experts``)."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from functional_pp.models.hf_switches import partial_rotary_factor, position_scaling
from functional_pp.models.llama import Config
from functional_pp.ops.rotary import LinearScaling, YarnScaling

__all__ = ["ARCHITECTURES", "LATENT", "FREE", "config_from_hf", "config_to_hf", "check_exportable", "RENAMED"]

ARCHITECTURES: dict[str, str] = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                                 "glm4_moe": "Glm4MoeForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
                                 "mistral4": "Mistral4ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
                                 "deepseek_v32": "DeepseekV32ForCausalLM"}
LATENT: tuple[str, ...] = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4", "glm_moe_dsa", "deepseek_v32")
SPARSE: tuple[str, ...] = ("glm_moe_dsa", "deepseek_v32")
"""The families with DeepSeek sparse attention (models/dsa.py); their dense layers by ``mlp_layer_types``."""
"""The families with multi-head latent attention."""

RENAMED: tuple[tuple[str, str], ...] = ((r"\.mlp\.shared_expert\.", ".mlp.shared_experts."),)
"""Their tensor names beside the table's: the shared expert is ``shared_experts``."""
FREE: dict[str, tuple[str, ...]] = {"mistral4": ("attn_temperature_floor",)}
"""Fields other families refuse that these hold (:func:`check_exportable` checks their values)."""
MISTRAL4_RENAMED = RENAMED + ((r"\.mlp\.experts\.down_proj\.weight$", ".mlp.experts.down_proj"),)
MISTRAL4_FUSED = tuple((f"{pre}.layers.{{i}}.mlp.experts.gate_up_proj",      # (alone, or in its mistral3 wrapper)
                        (f"{pre}.layers.{{i}}.mlp.experts.gate_proj.weight", f"{pre}.layers.{{i}}.mlp.experts.up_proj.weight"))
                       for pre in ("model", "language_model.model"))
MISTRAL4_KINDS = {"mlp.gate": "experts_tensor", "mlp.up": "experts_tensor", "mlp.down": "experts_tensor"}
"""Mistral Small 4's experts in its files: one tensor for all the experts, ``[E, out, in]``, gate and
up fused along the rows of ``experts.gate_up_proj`` (gate, then up)."""

# transformers' config class defaults of the keys read here
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, first_k_dense_replace=0, kv_lora_rank=512,
                        q_lora_rank=1536, n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, routed_scaling_factor=1.0, topk_method="greedy", v_head_dim=128,
                        moe_intermediate_size=1407, tie_word_embeddings=False),
    "deepseek_v3": dict(rms_norm_eps=1e-6, max_position_embeddings=4096, first_k_dense_replace=3, kv_lora_rank=512,
                        q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, routed_scaling_factor=2.5, v_head_dim=128, moe_intermediate_size=2048,
                        n_group=8, topk_group=4, num_experts_per_tok=8, norm_topk_prob=True, rope_interleave=True,
                        tie_word_embeddings=False),
    "glm4_moe": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, moe_intermediate_size=1408,
                     num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0,
                     n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False,
                     tie_word_embeddings=False),
    "glm4_moe_lite": dict(rms_norm_eps=1e-5, max_position_embeddings=202752, moe_intermediate_size=1536,
                          n_shared_experts=1, n_routed_experts=64, routed_scaling_factor=1.8, kv_lora_rank=512,
                          q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1,
                          topk_group=1, num_experts_per_tok=4, norm_topk_prob=True, rope_interleave=True,
                          tie_word_embeddings=False),
    "glm_moe_dsa": dict(rms_norm_eps=1e-5, max_position_embeddings=202752, moe_intermediate_size=2048,
                        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                        q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1,
                        topk_group=1, num_experts_per_tok=8, norm_topk_prob=True, rope_interleave=True,
                        tie_word_embeddings=False, first_k_dense_replace=3, index_topk=2048, index_head_dim=128,
                        index_n_heads=32),
    "deepseek_v32": dict(rms_norm_eps=1e-6, max_position_embeddings=163840, moe_intermediate_size=2048,
                         n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                         q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                         topk_group=4, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
                         first_k_dense_replace=3, index_topk=2048, index_head_dim=128, index_n_heads=64),
    "mistral4": dict(rms_norm_eps=1e-6, max_position_embeddings=1048576, first_k_dense_replace=0, kv_lora_rank=256,
                     q_lora_rank=1024, n_routed_experts=128, n_shared_experts=1, qk_nope_head_dim=64,
                     qk_rope_head_dim=64, routed_scaling_factor=1.0, v_head_dim=128, moe_intermediate_size=2048,
                     n_group=1, topk_group=1, num_experts_per_tok=4, norm_topk_prob=True, rope_interleave=True,
                     tie_word_embeddings=False),
}
# Mistral4Config's rope where config.json has none (YaRN with Llama 4's attention scaling by position)
_MISTRAL4_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=128.0, original_max_position_embeddings=8192,
                      beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1)
_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _refuse(where: str, what: str) -> None:
    """A refusal (``llama_hf`` raises it as ``UnsupportedHFConfig``)."""
    raise ValueError(f"{where}: {what}")


def _mscale(factor: float, m: float) -> float:
    """YaRN's magnitude scale (transformers' ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def config_from_hf(hf: dict, mt: str, rope_of: Callable) -> Config:
    """``Config`` of a DeepSeek-V2 / DeepSeek-V3 / GLM-4.5 / GLM-4.7-Flash ``config.json``
    (``rope_of(rope, hf, where, theta_default, partial_ok=)``: its rope's theta and scaling, as
    every family reads them); what the decoder cannot reproduce is refused by name (ValueError)."""
    where, d = f"HF {mt} config", _DEFAULTS[mt]

    def get(key: str) -> Any:
        return hf[key] if key in hf else d.get(key)
    for key, ok in (("hidden_act", "silu"), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            _refuse(where, f"{key}={hf[key]!r} is not supported (the functional decoder needs {ok!r})")
    if float(hf.get("attention_dropout") or 0.0):
        _refuse(where, f"attention_dropout={hf['attention_dropout']!r} is not supported (set it to 0.0)")
    latent = mt in LATENT
    layers, heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
    if mt == "mistral4" and not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        hf = dict(hf, rope_parameters=_MISTRAL4_ROPE)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = partial_rotary_factor(hf, 0.5 if mt == "glm4_moe" else 1.0)
    if mt == "mistral4":               # (its rope is sized by head_dim * partial_rotary_factor = qk_rope_head_dim)
        qk, rot = int(get("qk_nope_head_dim")) + int(get("qk_rope_head_dim")), int(get("qk_rope_head_dim"))
        partial = partial_rotary_factor(hf, rot / qk) * qk / rot
        if rope.get("rope_type", rope.get("type")) != "yarn":
            _refuse(where, f"rope type {rope.get('rope_type', rope.get('type'))!r} is not supported (transformers' "
                           f"Mistral4 sizes only YaRN's rotary by qk_rope_head_dim); only 'yarn'")
    if latent and partial != 1.0:
        _refuse(where, f"partial_rotary_factor={partial} is not supported with latent attention (it rotates "
                       f"all qk_rope_head_dim entries)")
    theta, scaling = rope_of(rope, hf, where, float(hf.get("rope_theta") or 10000.0), partial_ok=True)
    if latent and scaling is not None and not isinstance(scaling, (YarnScaling, LinearScaling)):
        _refuse(where, f"rope type {rope.get('rope_type', rope.get('type'))!r} is not supported with latent "
                       f"attention (only 'default', 'linear' and 'yarn')")
    fields: dict[str, Any] = dict(
        vocab=int(hf["vocab_size"]), hidden=int(hf["hidden_size"]), layers=layers, heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads), mlp=int(hf["intermediate_size"]),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(get("rms_norm_eps")),
        tie_embeddings=bool(get("tie_word_embeddings")), init_std=float(hf.get("initializer_range", 0.02)),
        max_seq=int(get("max_position_embeddings")), model_type=mt)
    bias = bool(hf.get("attention_bias", False))
    if latent:
        if bias:
            _refuse(where, "attention_bias=True is not supported with latent attention (biases of q_a_proj, "
                           "kv_a_proj_with_mqa and o_proj); only attention_bias=false")
        if fields["kv_heads"] != heads:
            _refuse(where, f"num_key_value_heads={fields['kv_heads']} != num_attention_heads={heads} is not "
                           f"supported with latent attention (every head expands its own k and v)")
        q_rank = get("q_lora_rank")
        nope, rot = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim"))
        fields.update(kv_lora_rank=int(get("kv_lora_rank")), q_lora_rank=None if q_rank is None else int(q_rank),
                      qk_nope_head_dim=nope, qk_rope_head_dim=rot, v_head_dim=int(get("v_head_dim")),
                      rotary_interleaved=True if mt == "deepseek_v2" else bool(get("rope_interleave")))
        m_all = float(rope.get("mscale_all_dim") or 0.0) if isinstance(scaling, YarnScaling) else 0.0
        if m_all:                         # transformers' yarn_apply_mscale: the softmax scale times mscale^2
            fields["query_pre_attn_scalar"] = (nope + rot) / _mscale(float(rope["factor"]), m_all) ** 4
        if mt == "mistral4":
            fields.update(position_scaling(hf, where))
        if mt in SPARSE:
            fields.update(_indexer(hf, mt, get, layers, where))
    else:
        head_dim = hf.get("head_dim")
        fields.update(head_dim=None if head_dim is None else int(head_dim), partial_rotary_factor=partial,
                      qkv_bias=bias, qk_norm=bool(get("use_qk_norm")))
    fields.update(_experts(hf, mt, get, layers, where))
    try:
        return Config(**fields)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def _indexer(hf: dict, mt: str, get, layers: int, where: str) -> dict:
    """GLM-5's and DeepSeek-V3.2's sparse attention fields (models/dsa.py): the main attention's
    rotary pairs interleaved (transformers rotates them so whatever ``rope_interleave`` says), the
    indexer's interleaved in GLM-5 and halves in DeepSeek-V3.2."""
    types = hf.get("indexer_types")
    if types is None and (int(hf.get("index_topk_freq") or 1) > 1 or hf.get("index_topk_pattern") is not None):
        _refuse(where, "index_topk_freq / index_topk_pattern with 'shared' layers (reusing an earlier layer's "
                       "top-k) is not supported; only every layer its own indexer ('full')")
    if types is not None and (len(types) != layers or set(types) != {"full"}):
        _refuse(where, f"indexer_types {types} is not supported: only 'full' in every layer ({layers}; 'shared' "
                       f"layers reuse an earlier layer's top-k)")
    return dict(index_topk=int(get("index_topk")), index_heads=int(get("index_n_heads")),
                index_head_dim=int(get("index_head_dim")), index_rotary_interleaved=mt == "glm_moe_dsa",
                rotary_interleaved=True)


def _experts(hf: dict, mt: str, get, layers: int, where: str) -> dict:
    """The experts' Config fields: sizes, the layers with experts, the router."""
    moe_mlp = int(get("moe_intermediate_size"))
    if mt in ("glm4_moe_lite", *SPARSE):
        first = 1 if mt == "glm4_moe_lite" else min(int(get("first_k_dense_replace")), layers)
        types = hf.get("mlp_layer_types") or ["dense"] * first + ["sparse"] * (layers - first)
        if len(types) != layers or set(types) - {"dense", "sparse"}:
            _refuse(where, f"mlp_layer_types {types} must be one of 'dense' / 'sparse' per layer ({layers})")
        moe = tuple(i for i, t in enumerate(types) if t == "sparse")
    else:
        if int(hf.get("moe_layer_freq") or 1) != 1:
            _refuse(where, f"moe_layer_freq={hf['moe_layer_freq']!r} is not supported (transformers' {mt} has "
                           f"experts in every layer from first_k_dense_replace on); only moe_layer_freq=1")
        moe = tuple(range(int(get("first_k_dense_replace") or 0), layers))
    out = dict(experts=int(get("n_routed_experts")), experts_top_k=int(get("num_experts_per_tok")), moe_mlp=moe_mlp,
               shared_expert_mlp=int(get("n_shared_experts") or 0) * moe_mlp, shared_expert_gate=False,
               moe_layers=None if len(moe) == layers else moe, routed_scaling_factor=float(get("routed_scaling_factor")))
    if mt == "mistral4":               # softmax scores, the best topk_group of n_group groups (their 2 best summed)
        out.update(router_score="softmax", norm_topk_prob=bool(get("norm_topk_prob")), router_group_score="top2_sum",
                   router_groups=int(get("n_group") or 1), router_topk_groups=int(get("topk_group") or 1))
    elif mt == "deepseek_v2":
        method = get("topk_method")
        if method not in _TOPK_METHODS:
            _refuse(where, f"topk_method={method!r} is not supported (only {', '.join(_TOPK_METHODS)}, as "
                           f"transformers' DeepseekV2)")
        grouped = method == "group_limited_greedy"
        out.update(router_score="softmax", norm_topk_prob=False, router_group_score="max",
                   router_groups=int(get("n_group")) if grouped else 1,
                   router_topk_groups=int(get("topk_group")) if grouped else 1)
    else:
        out.update(router_score="sigmoid", router_bias=True, norm_topk_prob=bool(get("norm_topk_prob")),
                   router_groups=int(get("n_group") or 1), router_topk_groups=int(get("topk_group") or 1))
    return out


def check_exportable(cfg: Config, plain: dict[str, Any], error: type = ValueError) -> None:
    """Refuse (``error``, naming the field) a config that its ``model_type``'s HF class cannot
    hold; ``plain``: the switches' values in Llama (which these families share)."""
    UnsupportedHFConfig = error
    mt, arch = cfg.model_type, ARCHITECTURES[cfg.model_type]
    where = f"export as {mt!r}"
    latent = mt in LATENT
    if mt == "mistral4" and not isinstance(cfg.rope_scaling, YarnScaling):
        raise UnsupportedHFConfig(f"{where}: rope_scaling {type(cfg.rope_scaling).__name__} is not exported for {mt} "
                                  f"(only yarn: transformers' Mistral4 sizes only YaRN's rotary by qk_rope_head_dim)")
    softmax = mt in ("deepseek_v2", "mistral4")
    need: dict[str, Any] = {**plain, "sliding_window": None, "o_bias": False,
                            "shared_expert_gate": False, "router_score": "softmax" if softmax else "sigmoid",
                            "router_bias": not softmax, "attn_temperature_floor": None}
    if mt == "mistral4":              # (every layer's queries scaled by position over YaRN's original length)
        need.update(attn_temperature_floor=float(cfg.rope_scaling.original_max_position), attn_temperature_offset=0.0,
                    attn_temperature_all_layers=True)
    del need["query_pre_attn_scalar"]
    if latent:
        need.update(qkv_bias=False, qk_norm=False)
    else:
        need.update(kv_lora_rank=0, partial_rotary_factor=cfg.partial_rotary_factor, qkv_bias=cfg.qkv_bias,
                    qk_norm=cfg.qk_norm, query_pre_attn_scalar=None)
    if mt == "deepseek_v2":
        need.update(rotary_interleaved=True, norm_topk_prob=False, router_group_score="max")
    else:
        need.update(router_group_score="top2_sum")
        if latent:
            need["rotary_interleaved"] = True if mt in SPARSE else cfg.rotary_interleaved
    need.update(index_topk=cfg.index_topk if mt in SPARSE else 0,
                index_rotary_interleaved=mt != "deepseek_v32")
    if mt in SPARSE and not cfg.index_topk:
        raise UnsupportedHFConfig(f"{where}: index_topk=0 has no {arch} equivalent (every layer has its indexer); "
                                  f"choose another model_type")
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise UnsupportedHFConfig(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs "
                                      f"{want!r}); choose another model_type")
    if latent != bool(cfg.kv_lora_rank):
        raise UnsupportedHFConfig(f"{where}: kv_lora_rank={cfg.kv_lora_rank} has no {arch} equivalent "
                                  f"({'latent attention needs kv_lora_rank > 0' if latent else 'it needs 0'})")
    if not cfg.experts:
        raise UnsupportedHFConfig(f"{where}: experts=0 has no {arch} equivalent (it has routed experts)")
    moe = [i for i in range(cfg.layers) if cfg.moe_layers is None or i in cfg.moe_layers]
    if mt not in ("glm4_moe_lite", *SPARSE) and moe != list(range(cfg.layers - len(moe), cfg.layers)):
        raise UnsupportedHFConfig(f"{where}: moe_layers={cfg.moe_layers} has no {arch} equivalent (dense layers "
                                  f"first, then experts in every layer: first_k_dense_replace)")
    if (cfg.moe_mlp is None) or cfg.shared_expert_mlp % cfg.moe_mlp:
        raise UnsupportedHFConfig(f"{where}: shared_expert_mlp={cfg.shared_expert_mlp} must be a multiple of "
                                  f"moe_mlp={cfg.moe_mlp} (n_shared_experts experts of moe_intermediate_size)")
    s = cfg.rope_scaling
    if s is not None and not isinstance(s, (YarnScaling, LinearScaling)):
        raise UnsupportedHFConfig(f"{where}: rope_scaling {type(s).__name__} is not exported for {mt} (only yarn "
                                  f"and linear)")
    if latent and cfg.query_pre_attn_scalar is not None and not isinstance(s, YarnScaling):
        raise UnsupportedHFConfig(f"{where}: query_pre_attn_scalar={cfg.query_pre_attn_scalar} has no {arch} "
                                  f"equivalent without YaRN (whose mscale_all_dim sets the softmax scale)")


def _rope_parameters(cfg: Config) -> dict:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    s = cfg.rope_scaling
    if isinstance(s, LinearScaling):
        rope.update(rope_type="linear", factor=float(s.factor))
    elif isinstance(s, YarnScaling):
        rope.update(rope_type="yarn", factor=float(s.factor), original_max_position_embeddings=s.original_max_position,
                    beta_fast=s.beta_fast, beta_slow=s.beta_slow, attention_factor=s.attention_factor,
                    truncate=s.truncate)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.kv_lora_rank and cfg.query_pre_attn_scalar is not None and s.factor > 1:
            m = (qk / cfg.query_pre_attn_scalar) ** 0.25          # the softmax scale's mscale, as mscale_all_dim
            rope["mscale_all_dim"] = round((m - 1.0) / (0.1 * math.log(s.factor)), 12)      # (read back alike)
    if cfg.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    return rope


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of ``cfg`` as its ``model_type``'s class (checked by
    :func:`check_exportable` before)."""
    mt, dname = cfg.model_type, str(dtype).removeprefix("torch.")
    rope = _rope_parameters(cfg)
    moe = [i for i in range(cfg.layers) if cfg.moe_layers is None or i in cfg.moe_layers]
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[mt]], "model_type": mt, "vocab_size": cfg.vocab, "hidden_size": cfg.hidden,
        "intermediate_size": cfg.mlp, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq,
        "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0, "use_cache": True, "rope_parameters": rope, "rope_theta": float(cfg.rope_theta),
        "attention_bias": cfg.qkv_bias, "dtype": dname, "torch_dtype": dname,
        "n_routed_experts": cfg.experts, "num_experts_per_tok": cfg.experts_top_k,
        "moe_intermediate_size": cfg.moe_mlp, "n_shared_experts": cfg.shared_expert_mlp // cfg.moe_mlp,
        "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
        "n_group": cfg.router_groups, "topk_group": cfg.router_topk_groups}
    if mt in ("glm4_moe_lite", *SPARSE):
        out["mlp_layer_types"] = ["sparse" if i in moe else "dense" for i in range(cfg.layers)]
    else:
        out["first_k_dense_replace"] = cfg.layers - len(moe)
    if mt == "deepseek_v2":
        out["topk_method"] = "group_limited_greedy" if cfg.router_groups > 1 else "greedy"
    if mt in LATENT:
        out.update(kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)
        if mt not in ("deepseek_v2", *SPARSE):
            out["rope_interleave"] = cfg.rotary_interleaved
        if mt in SPARSE:
            out.update(index_topk=cfg.index_topk, index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim)
        if mt == "glm_moe_dsa":
            out["indexer_types"] = ["full"] * cfg.layers
        if mt == "mistral4":          # (its rope sized by head_dim * partial_rotary_factor; the scaling by position)
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            out["head_dim"] = qk
            out["rope_parameters"].update(partial_rotary_factor=cfg.qk_rope_head_dim / qk,
                                          llama_4_scaling_beta=cfg.attn_temperature_scale)
    else:
        out.update(head_dim=cfg.dim_head, partial_rotary_factor=cfg.partial_rotary_factor, use_qk_norm=cfg.qk_norm)
    return out
