"""Arcee's AFMoE (``afmoe``: ``AfmoeForCausalLM``, the Trinity models) as a configuration of the one
decoder (docs/models.md, "Decoder families"): Llama's attention with per-head q/k norms and an output
gate (``attn_gate``: the attention's output times sigmoid of ``self_attn.gate_proj``, before
``o_proj``), sliding-window layers with every ``global_attn_every_n_layers``-th layer full, the rotary
only in the sliding layers (the full ones are ``nope_layers``), norms before and after attention and
the MLP (``sandwich_norms``: ``pre_mlp_layernorm`` / ``post_mlp_layernorm``), dense MLPs in the first
``num_dense_layers`` layers, then DeepSeek-V3's experts: sigmoid routing whose per-expert bias
(``expert_bias``, not trained) only chooses, the top-k weights renormalised and times
``route_scale``, ``num_shared_experts`` shared experts of ``moe_intermediate_size`` added ungated;
the experts one tensor per expert and projection in the files (``mlp.experts.{j}.gate_proj.weight``,
as the Trinity checkpoints and transformers' save write them; transformers fuses gate and up into
``experts.gate_up_proj`` ``[E, 2F, H]`` in memory only); muP's embedding times sqrt(hidden) (``mup_enabled``: ``scale_embeddings``).

``config.json`` <-> :class:`~functional_pp.models.llama.Config` (:func:`config_from_hf`,
:func:`config_to_hf`, :func:`check_exportable`); the tensor names are
:data:`functional_pp.models.llama_hf.LLAMA_TABLE`'s with :data:`RENAMED`."""
from __future__ import annotations

from typing import Any, Callable

import torch

from functional_pp.models.llama import Config

__all__ = ["ARCHITECTURES", "DEFAULTS", "FIXED", "RENAMED", "config_from_hf", "config_to_hf", "check_exportable"]

ARCHITECTURES: dict[str, str] = {"afmoe": "AfmoeForCausalLM"}

RENAMED: tuple[tuple[str, str], ...] = (
    (r"\.mlp\.gate\.weight$", ".mlp.router.gate.weight"),              # the router's Linear
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.expert_bias"),     # its choosing bias
    (r"\.mlp\.shared_expert\.", ".mlp.shared_experts."),
    (r"\.pre_feedforward_layernorm\.", ".pre_mlp_layernorm."),
    (r"\.post_feedforward_layernorm\.", ".post_mlp_layernorm."))
"""AFMoE's tensor names beside the table's."""

DEFAULTS: dict[str, Any] = dict(
    vocab_size=200192, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=1408, num_hidden_layers=32,
    num_dense_layers=1, num_attention_heads=16, head_dim=128, hidden_act="silu", max_position_embeddings=16384,
    initializer_range=0.02, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=64, num_experts_per_tok=6,
    num_shared_experts=2, route_scale=1.0, global_attn_every_n_layers=4, sliding_window=1024, attention_dropout=0.0,
    mup_enabled=False, attention_bias=False)
"""``AfmoeConfig``'s defaults of the keys read here (a config.json may leave them out)."""

FIXED: dict[str, Any] = dict(qk_norm=True, attn_gate=True, sandwich_norms=True, shared_expert_gate=False,
                             router_score="sigmoid", router_bias=True, norm_topk_prob=True, router_groups=1,
                             router_topk_groups=1, mlp_act="silu")
"""The fields ``AfmoeForCausalLM`` has one value of."""


def _refuse(where: str, what: str) -> None:
    raise ValueError(f"{where}: {what}")


def config_from_hf(hf: dict, mt: str, rope_of: Callable) -> Config:
    """``Config`` of an ``afmoe`` ``config.json`` (``rope_of(rope, hf, where, theta_default)``: its
    rope's theta and scaling, as every family reads them); a ValueError names what the decoder
    cannot reproduce."""
    where = f"HF {mt} config"

    def get(key: str) -> Any:
        v = hf.get(key)
        return DEFAULTS.get(key) if v is None else v
    if get("hidden_act") != "silu":
        _refuse(where, f"hidden_act={get('hidden_act')!r} is not supported (only 'silu')")
    if float(get("attention_dropout") or 0.0):
        _refuse(where, f"attention_dropout={hf['attention_dropout']!r} is not supported (set it to 0.0)")
    layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
    every = int(get("global_attn_every_n_layers"))
    types = tuple(hf.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                            for i in range(layers)])
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        _refuse(where, f"layer_types {list(types)} must be {layers} entries of sliding_attention / full_attention")
    window = hf["sliding_window"] if "sliding_window" in hf else DEFAULTS["sliding_window"]
    sliding = "sliding_attention" in types
    if sliding and window is None:
        _refuse(where, "sliding_window=None with sliding_attention layers is not supported (give the window)")
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta, scaling = rope_of(rope, hf, where, float(hf.get("rope_theta") or 10000.0))
    dense = int(get("num_dense_layers") or 0)
    moe_mlp = int(get("moe_intermediate_size"))
    bias = bool(get("attention_bias"))
    kv = hf.get("num_key_value_heads")
    try:
        return Config(
            model_type=mt, vocab=int(get("vocab_size")), hidden=int(get("hidden_size")), layers=layers, heads=heads,
            kv_heads=int(kv) if kv is not None else heads, mlp=int(get("intermediate_size")),
            head_dim=int(get("head_dim")), rope_theta=theta, rope_scaling=scaling, norm_eps=float(get("rms_norm_eps")),
            tie_embeddings=bool(get("tie_word_embeddings")), init_std=float(get("initializer_range")),
            max_seq=int(get("max_position_embeddings")), qkv_bias=bias, o_bias=bias,
            sliding_window=int(window) if sliding else None, layer_types=types if sliding else None,
            nope_layers=full or None, scale_embeddings=bool(get("mup_enabled")),
            experts=int(get("num_experts")), experts_top_k=int(get("num_experts_per_tok")), moe_mlp=moe_mlp,
            shared_expert_mlp=int(get("num_shared_experts") or 0) * moe_mlp,
            moe_layers=None if dense <= 0 else tuple(range(dense, layers)),
            routed_scaling_factor=float(get("route_scale")),
            router_aux_loss_coef=0.0, **FIXED)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def check_exportable(cfg: Config, plain: dict[str, Any], error: type = ValueError) -> None:
    """Refuse (``error``, naming the field) a config ``AfmoeForCausalLM`` cannot hold; ``plain``: the
    switches' values in Llama."""
    where, arch = f"export as {cfg.model_type!r}", ARCHITECTURES["afmoe"]
    need = {**plain, **FIXED, "o_bias": cfg.qkv_bias, "kv_lora_rank": 0, "norm_offset": 0.0,
            "query_pre_attn_scalar": None, "attn_softcap": None, "final_softcap": None, "local_rope_theta": None,
            "capacity_factor": None, "router_z_loss_coef": 0.0, "router_aux_loss_coef": 0.0}
    full = tuple(i for i in range(cfg.layers) if cfg.window(i) is None)
    need["nope_layers"] = full or None
    for key, want in need.items():
        if getattr(cfg, key) != want:
            extra = " (the full-attention layers: AFMoE rotates only in its sliding layers)" if key == "nope_layers" \
                else ""
            raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs {want!r}){extra}; "
                        f"choose another model_type")
    if not cfg.experts:
        raise error(f"{where}: experts=0 has no {arch} equivalent (it has routed experts)")
    moe = [i for i in range(cfg.layers) if cfg.moe_layers is None or i in cfg.moe_layers]
    if moe != list(range(cfg.layers - len(moe), cfg.layers)) or not moe:
        raise error(f"{where}: moe_layers={cfg.moe_layers} has no {arch} equivalent (dense layers first, then "
                    f"experts in every layer: num_dense_layers)")
    if cfg.moe_mlp is None or cfg.shared_expert_mlp % cfg.moe_mlp:
        raise error(f"{where}: shared_expert_mlp={cfg.shared_expert_mlp} must be a multiple of moe_mlp="
                    f"{cfg.moe_mlp} (num_shared_experts experts of moe_intermediate_size)")
    if cfg.rope_scaling is not None:
        raise error(f"{where}: rope_scaling {type(cfg.rope_scaling).__name__} is not exported for afmoe (only "
                    f"the default rope)")


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """The ``AfmoeForCausalLM`` ``config.json`` of ``cfg`` (checked by :func:`check_exportable` before)."""
    dname = str(dtype).removeprefix("torch.")
    moe = [i for i in range(cfg.layers) if cfg.moe_layers is None or i in cfg.moe_layers]
    return {
        "architectures": [ARCHITECTURES["afmoe"]], "model_type": "afmoe", "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp, "moe_intermediate_size": cfg.moe_mlp,
        "num_hidden_layers": cfg.layers, "num_dense_layers": cfg.layers - len(moe),
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_head,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "use_cache": True, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        "num_experts": cfg.experts, "num_experts_per_tok": cfg.experts_top_k,
        "num_shared_experts": cfg.shared_expert_mlp // cfg.moe_mlp, "route_scale": cfg.routed_scaling_factor,
        "sliding_window": cfg.sliding_window,
        "layer_types": [("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.layers)],
        "attention_dropout": 0.0, "mup_enabled": cfg.scale_embeddings, "attention_bias": cfg.qkv_bias,
        "dtype": dname, "torch_dtype": dname}
