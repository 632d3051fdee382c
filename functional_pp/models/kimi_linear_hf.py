"""Moonshot's Kimi Linear (``kimi_linear``: ``KimiLinearForCausalLM``) as a configuration of the one
decoder (docs/models.md, "Decoder families"): Kimi Delta Attention layers (``layer_types``
"linear_attention" in its files, "kimi_delta_attention" here: models/kimi_delta.py, Gated DeltaNet
with a decay per key channel) between multi-head latent attention layers without any rotary
(models/mla.py; every layer a NoPE layer, its qk_rope_head_dim part of the key still shared by the
heads), DeepSeek-V3's experts (a sigmoid router with a score correction and grouped top-k, the top-k
weights renormalised and scaled, shared experts added without a gate) after ``first_k_dense_replace``
dense layers (``mlp_layer_types``).

Files (the published checkpoint's layout, which transformers reads through its conversion mapping):
the delta attention under ``self_attn`` with its forget gate flat there (``f_a_proj``, ``f_b_proj``,
``dt_bias``, ``A_log`` [1, 1, heads, 1]) and one convolution per q / k / v (``q_conv1d`` ...); the
experts' layers under ``block_sparse_moe`` (router ``gate``, experts ``experts.{j}.w1 / w3 / w2``,
``shared_experts``), the dense layers' MLP under ``mlp``. ``config.json``'s keys are read under
transformers' names and the checkpoint's (``linear_attn_config``, ``num_experts``,
``num_expert_group``, ``moe_renormalize``, ``first_k_dense_replace``, ...)."""
from __future__ import annotations

from typing import Any

import torch

from functional_pp.models import kimi_delta
from functional_pp.models.llama import Config

__all__ = ["ARCHITECTURES", "RENAMED", "MODULE_NAMES", "ALSO_READ", "config_from_hf", "config_to_hf",
           "check_exportable"]

ARCHITECTURES: dict[str, str] = {"kimi_linear": "KimiLinearForCausalLM"}

RENAMED: tuple[tuple[str, str], ...] = (
    (r"\.kda\.conv_([qkv])\.weight$", r".self_attn.\1_conv1d.weight"), (r"\.kda\.", ".self_attn."),
    (r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight"),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".block_sparse_moe.gate.e_score_correction_bias"),
    (r"\.mlp\.experts\.gate_proj\.weight$", ".block_sparse_moe.experts.w1.weight"),
    (r"\.mlp\.experts\.up_proj\.weight$", ".block_sparse_moe.experts.w3.weight"),
    (r"\.mlp\.experts\.down_proj\.weight$", ".block_sparse_moe.experts.w2.weight"),
    (r"\.mlp\.shared_expert\.", ".block_sparse_moe.shared_experts."))
"""The table's names (models/llama_hf.py) in Kimi Linear's files."""

ALSO_READ: tuple[tuple[str, str], ...] = (
    (r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$", r".block_sparse_moe.\1.weight"),)
"""transformers' save writes the dense layers' MLP under ``block_sparse_moe`` too (its load-time rename
reversed); import reads it there where ``mlp`` is absent."""

MODULE_NAMES: tuple[tuple[str, str], ...] = (
    (r"\.block_sparse_moe\.", ".mlp."), (r"\.self_attn\.(f_a_proj|f_b_proj)\.", r".self_attn.forget_gate.\1."))
"""From a tensor's name in the files to its module's in transformers' model (its load-time renames)."""

# KimiLinearConfig's defaults of the keys read here (their names in transformers' class)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
    num_attention_heads=32, n_shared_experts=1, routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8,
    norm_topk_prob=True, hidden_act="silu", max_position_embeddings=1048576, initializer_range=0.02,
    rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0,
    num_local_experts=256, linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4)
_TOKEN_IDS = dict(pad_token_id=163839, bos_token_id=163584, eos_token_id=163586)
"""KimiLinearConfig's special token ids (written where the vocabulary holds them, else null)."""
# the checkpoint's names of those keys (KimiLinearConfig's attribute_map)
_ALIASES = {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
            "n_group": "num_expert_group", "num_local_experts": "num_experts",
            "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts"}
_TYPES = ("linear_attention", "full_attention")


def _layer_types(hf: dict, get, layers: int, where: str) -> tuple[list[str], list[str]]:
    """HF's layer_types and mlp_layer_types, as transformers derives them from either spelling."""
    lin = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if types is None and "full_attn_layers" in lin and "kda_layers" in lin:     # (1-indexed in the checkpoint)
        types = [None] * layers
        for i in lin["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lin["kda_layers"]:
            types[i - 1] = "linear_attention"
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    mlp = hf.get("mlp_layer_types") or ["dense" if i < int(hf.get("first_k_dense_replace", 1)) else "sparse"
                                        for i in range(layers)]
    if len(types) != layers or set(types) - set(_TYPES):
        raise ValueError(f"{where}: layer_types {list(types)} must be {layers} entries of {' / '.join(_TYPES)}")
    if len(mlp) != layers or set(mlp) - {"dense", "sparse"}:
        raise ValueError(f"{where}: mlp_layer_types {list(mlp)} must be {layers} entries of dense / sparse")
    return list(types), list(mlp)


def config_from_hf(hf: dict, mt: str) -> Config:
    """``Config`` of a ``kimi_linear`` ``config.json``; what the decoder cannot reproduce is refused by
    name (ValueError)."""
    where = f"HF {mt} config"
    lin = hf.get("linear_attn_config") or {}

    def get(key: str) -> Any:
        for k in (key, _ALIASES.get(key)):
            if k is not None and hf.get(k) is not None:
                return hf[k]
        return DEFAULTS.get(key)
    if get("hidden_act") != "silu":
        raise ValueError(f"{where}: hidden_act={get('hidden_act')!r} is not supported (only 'silu')")
    if float(get("attention_dropout") or 0.0):
        raise ValueError(f"{where}: attention_dropout={get('attention_dropout')!r} is not supported (set it to 0.0)")
    if get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=True is not supported (Kimi Linear's latent attention has no "
                         f"biases)")
    layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
    kv = hf.get("num_key_value_heads")
    if kv is not None and int(kv) != heads:
        raise ValueError(f"{where}: num_key_value_heads={kv} != num_attention_heads={heads} is not supported with "
                         f"latent attention (every head expands its own k and v)")
    types, mlp_types = _layer_types(hf, get, layers, where)
    moe = tuple(i for i, t in enumerate(mlp_types) if t == "sparse")
    moe_mlp, q_rank = int(get("moe_intermediate_size")), get("q_lora_rank")
    experts = dict(experts=int(get("num_local_experts")), experts_top_k=int(get("num_experts_per_tok")),
                   moe_mlp=moe_mlp, shared_expert_mlp=int(get("n_shared_experts") or 0) * moe_mlp,
                   shared_expert_gate=False, moe_layers=None if len(moe) == layers else moe,
                   routed_scaling_factor=float(get("routed_scaling_factor")), router_score="sigmoid",
                   router_bias=True, norm_topk_prob=bool(get("norm_topk_prob")),
                   router_groups=int(get("n_group") or 1),
                   router_topk_groups=int(get("topk_group") or 1)) if moe else {}
    linear_heads = int(lin.get("num_heads", get("linear_num_heads")))
    linear_dim = int(lin.get("head_dim", get("linear_head_dim")))
    try:
        return Config(
            model_type=mt, vocab=int(get("vocab_size")), hidden=int(get("hidden_size")), layers=layers, heads=heads,
            kv_heads=heads, mlp=int(get("intermediate_size")), rope_scaling=None, norm_eps=float(get("rms_norm_eps")),
            tie_embeddings=bool(get("tie_word_embeddings")), init_std=float(get("initializer_range")),
            max_seq=int(get("max_position_embeddings")), nope_layers=tuple(range(layers)),
            layer_types=tuple(kimi_delta.KIND if t == "linear_attention" else t for t in types),
            kv_lora_rank=int(get("kv_lora_rank")), q_lora_rank=None if q_rank is None else int(q_rank),
            qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")), linear_heads=linear_heads, linear_kv_heads=linear_heads,
            linear_head_dim=linear_dim, linear_v_head_dim=linear_dim,
            linear_conv_kernel=int(lin.get("short_conv_kernel_size", get("linear_conv_kernel_dim"))), **experts)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def check_exportable(cfg: Config, plain: dict[str, Any], error: type = ValueError) -> None:
    """Refuse (``error``, naming the field) a config ``KimiLinearForCausalLM`` cannot hold; ``plain``: the
    switches' values in Llama."""
    where, arch = f"export as {cfg.model_type!r}", ARCHITECTURES["kimi_linear"]
    need = {**plain, "nope_layers": tuple(range(cfg.layers)), "qkv_bias": False, "o_bias": False, "qk_norm": False,
            "sliding_window": None, "query_pre_attn_scalar": None, "attn_softcap": None, "final_softcap": None,
            "q_gate": False, "rope_scaling": None, "shared_expert_gate": False, "router_score": "sigmoid",
            "router_bias": True, "router_group_score": "top2_sum", "capacity_factor": None, "router_z_loss_coef": 0.0,
            "linear_kv_heads": cfg.linear_heads, "linear_v_head_dim": cfg.linear_head_dim,
            "mlp_act": "silu", "norm_offset": 0.0, "scale_embeddings": False, "sandwich_norms": False}
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs {want!r}); "
                        f"choose another model_type")
    types = set(cfg.layer_types or ())
    if not cfg.kv_lora_rank or types - {kimi_delta.KIND, "full_attention"}:
        raise error(f"{where}: kv_lora_rank={cfg.kv_lora_rank}, layer_types={list(cfg.layer_types or [])} have no "
                    f"{arch} equivalent (each layer kimi_delta_attention or latent full_attention, kv_lora_rank > 0)")
    if cfg.experts and (cfg.moe_mlp is None or cfg.shared_expert_mlp % cfg.moe_mlp):
        raise error(f"{where}: shared_expert_mlp={cfg.shared_expert_mlp} must be a multiple of moe_mlp={cfg.moe_mlp} "
                    f"(num_shared_experts experts of moe_intermediate_size)")


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """The ``KimiLinearForCausalLM`` ``config.json`` of ``cfg`` (checked by :func:`check_exportable` before)."""
    dname = str(dtype).removeprefix("torch.")
    moe = [i for i in range(cfg.layers) if cfg.experts and (cfg.moe_layers is None or i in cfg.moe_layers)]
    return {
        "architectures": [ARCHITECTURES["kimi_linear"]], "model_type": "kimi_linear", "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq, "initializer_range": cfg.init_std, "rms_norm_eps": cfg.norm_eps,
        "use_cache": True, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "layer_types": ["linear_attention" if t == kimi_delta.KIND else t for t in cfg.layer_types],
        "mlp_layer_types": ["sparse" if i in moe else "dense" for i in range(cfg.layers)],
        "linear_num_heads": cfg.linear_heads, "linear_head_dim": cfg.linear_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel, "moe_intermediate_size": cfg.moe_mlp or cfg.mlp,
        "num_local_experts": cfg.experts, "num_experts_per_tok": cfg.experts_top_k,
        "n_shared_experts": cfg.shared_expert_mlp // (cfg.moe_mlp or cfg.mlp) if cfg.experts else 0,
        "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
        "n_group": cfg.router_groups, "topk_group": cfg.router_topk_groups, "dtype": dname, "torch_dtype": dname,
        **{k: v if v < cfg.vocab else None for k, v in _TOKEN_IDS.items()},
        **({"pad_token_id": cfg.pad_token_id} if cfg.pad_token_id is not None else {})}
