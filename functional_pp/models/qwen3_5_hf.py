"""Qwen3.5 (``qwen3_5_text``: ``Qwen3_5ForCausalLM``; the text decoder of the multimodal ``qwen3_5``,
``Qwen3_5ForConditionalGeneration``) as a configuration of the one decoder (docs/models.md,
"Decoder families"): Gated DeltaNet layers (``layer_types`` "linear_attention",
models/gated_deltanet.py) interleaved with full-attention layers whose q_proj also holds each
head's output gate (``q_gate``), per-head q/k RMSNorms, (1 + w) RMSNorms (``norm_offset: 1``),
partial rotary (``partial_rotary_factor``, 0.25 by default; the multimodal rotary's sections
coincide for text, whose three position ids are equal). Qwen3.5-MoE (``qwen3_5_moe_text``,
``qwen3_5_moe``): the same layers with experts in every layer (softmax routing, the top-k weights
renormalised, a shared expert behind a sigmoid gate: Qwen2-MoE's, models/moe.py), one tensor per
expert and projection in the files (``mlp.experts.{j}.gate_proj.weight``, as transformers saves them
and the published checkpoints hold them; transformers fuses them in memory only). Qwen3-Next
(``qwen3_next``: ``Qwen3NextForCausalLM``): the same layers, experts every ``decoder_sparse_step``-th
layer but ``mlp_only_layers`` (the others dense), ``norm_topk_prob`` read; its files hold q, k, v and
z in ``linear_attn.in_proj_qkvz`` and b and a in ``in_proj_ba`` group by group, one group per key head
(:data:`HEAD_GROUPED`: each device reads its heads' rows of each part).

Files: HF's fused ``linear_attn.in_proj_qkv`` [q | k | v rows] and the depthwise
``linear_attn.conv1d.weight`` [channels, 1, K] (its channels the same q | k | v) are split on
import into ``in_proj_{q,k,v}`` and ``conv_{q,k,v}`` (each device reading its heads' rows) and
fused on export (:data:`FUSED`); the multimodal checkpoint's decoder lives under
``model.language_model.``, its vision tower and multi-token-prediction layers are left aside."""
from __future__ import annotations

from typing import Any, Callable

import torch

from functional_pp.models.llama import Config

__all__ = ["ARCHITECTURES", "DEFAULTS", "MOE_DEFAULTS", "FIXED", "MOE_FIXED", "MOE", "NEXT_DEFAULTS", "HEAD_GROUPED",
           "RENAMED", "FUSED",
           "IGNORED", "TEXT_TYPES", "config_from_hf", "config_to_hf", "check_exportable"]

ARCHITECTURES: dict[str, str] = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                                 "qwen3_next": "Qwen3NextForCausalLM"}

TEXT_TYPES: dict[str, str] = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
"""The multimodal model types whose text decoder export writes as its text class."""

MOE: tuple[str, ...] = ("qwen3_5_moe_text", "qwen3_5_moe")
"""The model types with experts in every layer (Qwen3-Next: where its config puts them)."""

_PREFIX = {"qwen3_5_text": "model", "qwen3_5": "model.language_model", "qwen3_5_moe_text": "model",
           "qwen3_5_moe": "model.language_model"}
RENAMED: dict[str, tuple[tuple[str, str], ...]] = {mt: ((r"^model\.", "model.language_model."),) for mt in TEXT_TYPES}
"""The multimodal checkpoint's text decoder lives under ``model.language_model.``."""

FUSED: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    mt: tuple((f"{pre}.layers.{{i}}.linear_attn.{fused}.weight",
               tuple(f"{pre}.layers.{{i}}.linear_attn.{part}_{x}.weight" for x in "qkv"))
              for fused, part in (("in_proj_qkv", "in_proj"), ("conv1d", "conv")))
    for mt, pre in _PREFIX.items()}
FUSED["qwen3_next"] = (
    ("model.layers.{i}.linear_attn.in_proj_qkvz.weight",
     tuple(f"model.layers.{{i}}.linear_attn.in_proj_{x}.weight" for x in "qkvz")),
    ("model.layers.{i}.linear_attn.in_proj_ba.weight",
     tuple(f"model.layers.{{i}}.linear_attn.in_proj_{x}.weight" for x in "ba")),
    ("model.layers.{i}.linear_attn.conv1d.weight",
     tuple(f"model.layers.{{i}}.linear_attn.conv_{x}.weight" for x in "qkv")))
"""q, k and v along the rows of ``in_proj_qkv`` and along the channels of the convolution (Qwen3-Next:
q, k, v and z in ``in_proj_qkvz``, b and a in ``in_proj_ba``, held key head by key head)."""

HEAD_GROUPED: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen3_next": ((r"\.linear_attn\.in_proj_(qkvz|ba)\.", "linear_kv_heads"),)}
"""Qwen3-Next's fused projections: their parts group by group, one group per linear-attention key head."""

IGNORED: dict[str, tuple[str, ...]] = {mt: (r"mtp\..*", r"model\.visual\..*") for mt in ARCHITECTURES}
"""Tensors the text decoder does not read: the vision tower, the multi-token-prediction layers."""

DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768, initializer_range=0.02,
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, head_dim=256,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, full_attention_interval=4)
"""``Qwen3_5TextConfig``'s defaults of the keys read here."""

MOE_DEFAULTS: dict[str, Any] = dict(DEFAULTS, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2,
                                    moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                    num_experts_per_tok=8, num_experts=256, router_aux_loss_coef=0.001)
"""``Qwen3_5MoeTextConfig``'s."""

NEXT_DEFAULTS: dict[str, Any] = dict(
    MOE_DEFAULTS, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
    num_experts_per_tok=10, num_experts=512, norm_topk_prob=True, decoder_sparse_step=1)
"""``Qwen3NextConfig``'s."""

MOE_FIXED: dict[str, Any] = dict(norm_topk_prob=True, router_score="softmax", shared_expert_gate=True, moe_layers=None)
"""The expert options ``Qwen3_5MoeForCausalLM`` has one value of."""

FIXED: dict[str, Any] = dict(q_gate=True, qk_norm=True, norm_offset=1.0, mlp_act="silu")
"""The fields ``Qwen3_5ForCausalLM`` has one value of."""

_TYPES = ("linear_attention", "full_attention")


def text_config(hf: dict, mt: str) -> dict:
    """The text decoder's keys: a multimodal ``qwen3_5``'s ``text_config`` (its tying from the top level)."""
    if mt in TEXT_TYPES:
        text = dict(hf.get("text_config") or {})
        if not text:
            raise ValueError(f"HF {mt} config: text_config is missing (the text decoder's sizes are unknown)")
        if "tie_word_embeddings" in hf:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        return text
    return hf


def config_from_hf(hf: dict, mt: str, rope_of: Callable) -> Config:
    """``Config`` of a ``qwen3_5_text`` / ``qwen3_5`` ``config.json`` (``rope_of(rope, hf, where,
    theta_default, partial_ok=)``: its rope's theta and scaling); a ValueError names what the decoder
    cannot reproduce."""
    where = f"HF {mt} config"
    hf = text_config(hf, mt)
    defaults = NEXT_DEFAULTS if mt == "qwen3_next" else MOE_DEFAULTS if mt in MOE else DEFAULTS

    def get(key: str) -> Any:
        v = hf.get(key)
        return defaults.get(key) if v is None else v
    if get("hidden_act") != "silu":
        raise ValueError(f"{where}: hidden_act={get('hidden_act')!r} is not supported (only 'silu')")
    if float(get("attention_dropout") or 0.0):
        raise ValueError(f"{where}: attention_dropout={hf['attention_dropout']!r} is not supported (set it to 0.0)")
    if get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=True is not supported (Qwen3.5's attention has no biases)")
    layers = int(get("num_hidden_layers"))
    every = int(get("full_attention_interval"))
    types = tuple(hf.get("layer_types") or [_TYPES[0] if (i + 1) % every else _TYPES[1] for i in range(layers)])
    if len(types) != layers or set(types) - set(_TYPES):
        raise ValueError(f"{where}: layer_types {list(types)} must be {layers} entries of {' / '.join(_TYPES)}")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    # the multimodal rotary (read by batches with images' 3D positions; text positions rotate alike in every
    # section): transformers interleaves Qwen3.5's sections whatever mrope_interleaved says
    mrope = tuple(int(x) for x in rope.pop("mrope_section", None) or (11, 11, 10)) if mt != "qwen3_next" else None
    rope.pop("mrope_interleaved", None)
    theta, scaling = rope_of(rope, {**hf, "rope_parameters": rope}, where, float(hf.get("rope_theta") or 10000.0),
                             partial_ok=True)
    heads = int(get("num_attention_heads"))
    kv = get("num_key_value_heads")
    moe: dict[str, Any] = {}
    chosen = tuple(range(layers))
    if mt == "qwen3_next":          # experts every decoder_sparse_step-th layer but mlp_only_layers
        step, dense = int(get("decoder_sparse_step")), set(hf.get("mlp_only_layers") or ())
        chosen = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0) if int(get("num_experts")) \
            else ()
    if chosen and (mt in MOE or mt == "qwen3_next"):
        moe = dict(MOE_FIXED, experts=int(get("num_experts")), experts_top_k=int(get("num_experts_per_tok")),
                   moe_mlp=int(get("moe_intermediate_size")),
                   shared_expert_mlp=int(get("shared_expert_intermediate_size")),
                   router_aux_loss_coef=float(get("router_aux_loss_coef")) if hf.get("output_router_logits") else 0.0)
        if mt == "qwen3_next":
            moe.update(norm_topk_prob=bool(get("norm_topk_prob")), moe_layers=None if len(chosen) == layers else chosen)
    try:
        return Config(
            model_type=mt, vocab=int(get("vocab_size")), hidden=int(get("hidden_size")), layers=layers, heads=heads,
            kv_heads=int(kv) if kv is not None else heads,
            mlp=int(get("moe_intermediate_size") if mt in MOE else get("intermediate_size")),
            head_dim=int(get("head_dim")), rope_theta=theta, rope_scaling=scaling, norm_eps=float(get("rms_norm_eps")),
            tie_embeddings=bool(get("tie_word_embeddings")), init_std=float(get("initializer_range")),
            max_seq=int(get("max_position_embeddings")), layer_types=types,
            partial_rotary_factor=float(rope["partial_rotary_factor"]),
            linear_heads=int(get("linear_num_value_heads")), linear_kv_heads=int(get("linear_num_key_heads")),
            linear_head_dim=int(get("linear_key_head_dim")), linear_v_head_dim=int(get("linear_value_head_dim")),
            linear_conv_kernel=int(get("linear_conv_kernel_dim")), mrope_section=mrope,
            mrope_interleaved=mrope is not None, **FIXED, **moe)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def check_exportable(cfg: Config, plain: dict[str, Any], error: type = ValueError) -> None:
    """Refuse (``error``, naming the field) a config ``Qwen3_5ForCausalLM`` cannot hold; ``plain``: the
    switches' values in Llama."""
    moe, nxt = cfg.model_type in MOE, cfg.model_type == "qwen3_next"
    where = f"export as {cfg.model_type!r}"
    arch = ARCHITECTURES["qwen3_5_moe_text" if moe else cfg.model_type if nxt else "qwen3_5_text"]
    fixed = {k: v for k, v in MOE_FIXED.items() if k not in ("norm_topk_prob", "moe_layers")} if nxt else MOE_FIXED
    need = {**plain, **FIXED, **(fixed if moe or nxt and cfg.experts else {"experts": 0}), "qkv_bias": False,
            "o_bias": False, "kv_lora_rank": 0, "sliding_window": None, "query_pre_attn_scalar": None,
            "attn_softcap": None, "final_softcap": None,
            "local_rope_theta": None, "scale_embeddings": False, "sandwich_norms": False}
    for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
        need.pop(key, None)
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs {want!r}); "
                        f"choose another model_type")
    if cfg.layer_types is None or set(cfg.layer_types) - set(_TYPES):
        raise error(f"{where}: layer_types={cfg.layer_types!r} has no {arch} equivalent (each layer "
                    f"{' or '.join(_TYPES)})")
    if (moe or nxt and cfg.experts) and not (cfg.experts and cfg.moe_mlp and cfg.shared_expert_mlp):
        raise error(f"{where}: experts={cfg.experts}, moe_mlp={cfg.moe_mlp}, shared_expert_mlp={cfg.shared_expert_mlp} "
                    f"have no {arch} equivalent (experts in every layer beside a gated shared expert)")
    if (moe or nxt) and (cfg.capacity_factor is not None or cfg.router_z_loss_coef):
        raise error(f"{where}: capacity_factor / router_z_loss_coef have no {arch} equivalent (dropless, no z-loss)")
    if cfg.rope_scaling is not None:
        raise error(f"{where}: rope_scaling {type(cfg.rope_scaling).__name__} is not exported for {cfg.model_type} "
                    f"(only the default rope)")


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """The ``Qwen3_5ForCausalLM`` ``config.json`` of ``cfg`` (checked by :func:`check_exportable` before)."""
    dname = str(dtype).removeprefix("torch.")
    mt = "qwen3_5_moe_text" if cfg.model_type in MOE else cfg.model_type if cfg.model_type == "qwen3_next" \
        else "qwen3_5_text"
    out = {
        "architectures": [ARCHITECTURES[mt]], "model_type": mt, "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_head,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "use_cache": True, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta),
                            "partial_rotary_factor": cfg.partial_rotary_factor,
                            **({"mrope_section": list(cfg.mrope_section), "mrope_interleaved": True}
                               if cfg.mrope_section is not None else {})},
        "attention_bias": False, "attention_dropout": 0.0, "layer_types": list(cfg.layer_types),
        "linear_conv_kernel_dim": cfg.linear_conv_kernel, "linear_key_head_dim": cfg.linear_head_dim,
        "linear_value_head_dim": cfg.linear_v_head_dim, "linear_num_key_heads": cfg.linear_kv_heads,
        "linear_num_value_heads": cfg.linear_heads, "dtype": dname, "torch_dtype": dname}
    if mt in MOE:
        del out["intermediate_size"]
        out.update(num_experts=cfg.experts, num_experts_per_tok=cfg.experts_top_k, moe_intermediate_size=cfg.moe_mlp,
                   shared_expert_intermediate_size=cfg.shared_expert_mlp, router_aux_loss_coef=cfg.router_aux_loss_coef,
                   output_router_logits=bool(cfg.router_aux_loss_coef))
    if mt == "qwen3_next":
        moe = [i for i in range(cfg.layers) if cfg.experts and (cfg.moe_layers is None or i in cfg.moe_layers)]
        out.update(num_experts=cfg.experts, num_experts_per_tok=cfg.experts_top_k,
                   moe_intermediate_size=cfg.moe_mlp or cfg.mlp, shared_expert_intermediate_size=cfg.shared_expert_mlp,
                   norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(cfg.layers) if i not in moe],
                   router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=bool(cfg.router_aux_loss_coef))
    return out
