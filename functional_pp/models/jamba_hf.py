"""AI21's Jamba (``jamba``: ``JambaForCausalLM``) as a configuration of the one decoder (docs/models.md,
"Decoder families"): a Mamba (v1) mixer with RMSNorms of its time step, B and C (``layer_blocks``
``mamba1+mlp``, models/mamba1.py) or attention without positions (every ``attn_layer_period``-th
layer from ``attn_layer_offset``: ``attention+mlp``, every layer a NoPE layer), then a SwiGLU MLP or,
every ``expert_layer_period``-th layer from ``expert_layer_offset``, experts (``moe_layers``, models/moe.py:
softmax router, top-k weights not renormalised); norms ``input_layernorm`` / ``pre_ff_layernorm``, the
final ``final_layernorm``; files name the MLP ``feed_forward``, its router ``feed_forward.router`` and
the experts one tensor each (``feed_forward.experts.{j}.gate_proj``, ...).

``config.json`` <-> :class:`~functional_pp.models.llama.Config` (:func:`config_from_hf`,
:func:`config_to_hf`, :func:`check_exportable`); the tensor names are the table's with :data:`RENAMED`."""
from __future__ import annotations

import math
from typing import Any

import torch

from functional_pp.models.llama import Config

__all__ = ["ARCHITECTURES", "DEFAULTS", "RENAMED", "config_from_hf", "config_to_hf", "check_exportable"]

ARCHITECTURES: dict[str, str] = {"jamba": "JambaForCausalLM"}

RENAMED: tuple[tuple[str, str], ...] = (
    (r"\.mamba1\.", ".mamba."), (r"\.post_attention_layernorm\.", ".pre_ff_layernorm."),
    (r"^model\.norm\.", "model.final_layernorm."), (r"\.mlp\.gate\.weight$", ".feed_forward.router.weight"),
    (r"\.mlp\.", ".feed_forward."))
"""Jamba's tensor names beside the table's."""

DEFAULTS: dict[str, Any] = dict(
    vocab_size=65536, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6,
    output_router_logits=False, router_aux_loss_coef=0.001, max_position_embeddings=262144, attention_dropout=0.0,
    num_experts_per_tok=2, num_experts=16, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8,
    attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto",
    mamba_conv_bias=True, mamba_proj_bias=False)
"""``JambaConfig``'s defaults of the keys read here (a config.json may leave them out)."""


def config_from_hf(hf: dict, mt: str) -> Config:
    """``Config`` of a ``jamba`` ``config.json``; a ValueError names what the decoder cannot reproduce."""
    where = f"HF {mt} config"

    def get(key: str) -> Any:
        v = hf.get(key)
        return DEFAULTS.get(key) if v is None else v
    if get("hidden_act") != "silu":
        raise ValueError(f"{where}: hidden_act={get('hidden_act')!r} is not supported (only 'silu')")
    if float(get("attention_dropout") or 0.0):
        raise ValueError(f"{where}: attention_dropout={get('attention_dropout')!r} is not supported (set it to 0.0)")
    hidden, layers, heads = int(get("hidden_size")), int(get("num_hidden_layers")), int(get("num_attention_heads"))
    rank = get("mamba_dt_rank")
    rank = math.ceil(hidden / 16) if rank == "auto" else int(rank)
    attn_period, attn_offset = int(get("attn_layer_period")), int(get("attn_layer_offset"))
    exp_period, exp_offset = int(get("expert_layer_period")), int(get("expert_layer_offset"))
    experts = int(get("num_experts"))
    moe = tuple(i for i in range(layers) if i % exp_period == exp_offset) if experts > 1 else ()
    kv = get("num_key_value_heads")
    return Config(
        model_type=mt, vocab=int(get("vocab_size")), hidden=hidden, layers=layers, heads=heads,
        kv_heads=int(kv) if kv is not None else heads, mlp=int(get("intermediate_size")), head_dim=hidden // heads,
        rope_scaling=None, nope_layers=tuple(range(layers)), norm_eps=float(get("rms_norm_eps")),
        tie_embeddings=bool(get("tie_word_embeddings")), init_std=float(get("initializer_range")),
        max_seq=int(get("max_position_embeddings")),
        layer_blocks=tuple("attention+mlp" if i % attn_period == attn_offset else "mamba1+mlp" for i in range(layers)),
        mamba1_inner=int(get("mamba_expand")) * hidden, mamba1_dt_rank=rank, mamba1_dt_norms=True,
        ssm_state=int(get("mamba_d_state")), conv_kernel=int(get("mamba_d_conv")),
        mamba_conv_bias=bool(get("mamba_conv_bias")), mamba_proj_bias=bool(get("mamba_proj_bias")),
        **(dict(experts=experts, experts_top_k=int(get("num_experts_per_tok")), norm_topk_prob=False,
                moe_layers=moe, router_aux_loss_coef=float(get("router_aux_loss_coef"))
                if hf.get("output_router_logits") else 0.0) if moe else {}))


def _pattern(layers: list[int], n: int, what: str, where: str) -> tuple[int, int]:
    """``(period, offset)`` with exactly ``layers`` among ``range(n)`` (refused when none fits)."""
    for period in range(1, n + 1):
        for offset in range(period):
            if [i for i in range(n) if i % period == offset] == layers:
                return period, offset
    raise ValueError(f"{where}: the {what} layers {layers} are not every period-th layer from an offset "
                     f"(JambaConfig's {what}_layer_period / _offset)")


def check_exportable(cfg: Config, plain: dict[str, Any], error: type = ValueError) -> None:
    """Refuse (``error``, naming the field) a config ``JambaForCausalLM`` cannot hold."""
    where, arch = f"export as {cfg.model_type!r}", ARCHITECTURES["jamba"]
    blocks = cfg.layer_blocks or ()
    need = {**{k: v for k, v in plain.items() if k not in ("layer_blocks", "mamba1_inner", "mamba1_dt_rank",
                                                           "mamba1_dt_norms", "nope_layers")},
            "nope_layers": tuple(range(cfg.layers)), "mamba1_dt_norms": True, "qkv_bias": False, "o_bias": False,
            "qk_norm": False, "norm_offset": 0.0, "sliding_window": None, "mlp_act": "silu", "norm_topk_prob": False,
            "router_score": "softmax", "shared_expert_mlp": 0, "moe_mlp": None}
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs {want!r}); choose "
                        f"another model_type")
    if len(blocks) != cfg.layers or set(blocks) - {"attention+mlp", "mamba1+mlp"} or not cfg.mamba1_inner \
            or cfg.mamba1_inner % cfg.hidden:
        raise error(f"{where}: layer_blocks={blocks}, mamba1_inner={cfg.mamba1_inner}: {arch}'s layers are "
                    f"attention+mlp or mamba1+mlp, the mixers' width a multiple of hidden (mamba_expand)")
    try:
        _pattern([i for i, b in enumerate(blocks) if b == "attention+mlp"], cfg.layers, "attn", where)
        if cfg.experts:
            _pattern(list(cfg.moe_layers or range(cfg.layers)), cfg.layers, "expert", where)
    except ValueError as exc:
        raise error(str(exc)) from exc


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """The ``JambaForCausalLM`` ``config.json`` of ``cfg`` (checked by :func:`check_exportable` before)."""
    dname = str(dtype).removeprefix("torch.")
    m, where = cfg.mamba1, f"export as {cfg.model_type!r}"
    attn = _pattern([i for i, b in enumerate(cfg.layer_blocks) if b == "attention+mlp"], cfg.layers, "attn", where)
    expert = (_pattern(list(cfg.moe_layers or range(cfg.layers)), cfg.layers, "expert", where) if cfg.experts
              else (1, 0))
    return {"architectures": [ARCHITECTURES["jamba"]], "model_type": "jamba", "vocab_size": cfg.vocab,
            "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.mlp, "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
            "max_position_embeddings": cfg.max_seq, "attention_dropout": 0.0,
            "attn_layer_period": attn[0], "attn_layer_offset": attn[1],
            "expert_layer_period": expert[0], "expert_layer_offset": expert[1],
            "num_experts": cfg.experts or 1, "num_experts_per_tok": cfg.experts_top_k if cfg.experts else 1,
            "output_router_logits": bool(cfg.router_aux_loss_coef), "router_aux_loss_coef":
                cfg.router_aux_loss_coef or DEFAULTS["router_aux_loss_coef"],
            "mamba_d_state": m.state, "mamba_d_conv": m.conv_kernel, "mamba_expand": m.inner // cfg.hidden,
            "mamba_dt_rank": m.dt_rank, "mamba_conv_bias": m.conv_bias, "mamba_proj_bias": m.proj_bias,
            "use_mamba_kernels": False, "dtype": dname, "torch_dtype": dname}
