"""TII's Falcon-H1 (``falcon_h1``: ``FalconH1ForCausalLM``) as a configuration of the one decoder
(docs/models.md, "Decoder families"): every layer a Mamba2 mixer and attention in parallel from one
norm (``layer_blocks`` ``mamba2|attention+mlp``; models/mamba2.py), then a SwiGLU MLP after its own
norm (``pre_ff_layernorm``), with its muP multipliers: the embedding's, the mixer's input
(``ssm_in_multiplier``), its projections z, x, B, C, dt (``ssm_multipliers``: transformers'
``mup_vector``) and output (``ssm_out_multiplier``), the attention's input and output
(``attention_in_multiplier``, ``attention_out_multiplier``), the keys (``key_multiplier``), the MLP's
gate and output (``mlp_multipliers``), the logits (``lm_head_multiplier``); the mixer's output gated
without a norm (``mamba_rms_norm`` false) or with one, after or before the gate
(``mamba_norm_before_gate``).

``config.json`` <-> :class:`~functional_pp.models.llama.Config` (:func:`config_from_hf`,
:func:`config_to_hf`, :func:`check_exportable`); the tensor names are the table's with :data:`RENAMED`."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from functional_pp.models.llama import Config

__all__ = ["ARCHITECTURES", "RENAMED", "DEFAULTS", "config_from_hf", "config_to_hf", "check_exportable"]

ARCHITECTURES: dict[str, str] = {"falcon_h1": "FalconH1ForCausalLM"}

RENAMED: tuple[tuple[str, str], ...] = (
    (r"\.mlp\.", ".feed_forward."), (r"\.post_attention_layernorm\.", ".pre_ff_layernorm."),
    (r"^model\.norm\.", "model.final_layernorm."))
"""Falcon-H1's tensor names beside the table's: the MLP ``feed_forward``, its norm ``pre_ff_layernorm``."""

BLOCK = "mamba2|attention+mlp"

DEFAULTS: dict[str, Any] = dict(
    vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-5,
    max_position_embeddings=8192, attention_dropout=0.0, mamba_d_ssm=1024, mamba_n_heads=128, mamba_d_head="auto",
    mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True,
    mamba_proj_bias=False, mamba_norm_before_gate=True, mamba_rms_norm=False, time_step_limit=(0.0, math.inf),
    projectors_bias=False, lm_head_multiplier=1.0, embedding_multiplier=1.0, mlp_multipliers=None, key_multiplier=1.0,
    attention_out_multiplier=1.0, attention_in_multiplier=1.0, ssm_multipliers=None, ssm_in_multiplier=1.0,
    ssm_out_multiplier=1.0, attention_bias=False, mlp_bias=False)
"""``FalconH1Config``'s defaults of the keys read here."""


def _float(v: Any) -> float:
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def config_from_hf(hf: dict, mt: str, rope_of: Callable) -> Config:
    """``Config`` of a ``falcon_h1`` ``config.json`` (``rope_of(rope, hf, where, theta_default)``: its
    rope's theta and scaling); a ValueError names what the decoder cannot reproduce."""
    where = f"HF {mt} config"

    def get(key: str) -> Any:
        v = hf.get(key)
        return DEFAULTS.get(key) if v is None else v
    for key, want in (("hidden_act", "silu"), ("mamba_proj_bias", False), ("projectors_bias", False),
                      ("mlp_bias", False)):
        if get(key) != want:
            raise ValueError(f"{where}: {key}={get(key)!r} is not supported (only {want!r})")
    if float(get("attention_dropout") or 0.0):
        raise ValueError(f"{where}: attention_dropout={get('attention_dropout')!r} is not supported (set it to 0.0)")
    hidden, heads, layers = int(get("hidden_size")), int(get("num_attention_heads")), int(get("num_hidden_layers"))
    inner = int(hf["mamba_d_ssm"]) if hf.get("mamba_d_ssm") is not None else int(get("mamba_expand")) * hidden
    m_heads = int(get("mamba_n_heads"))
    m_head_dim = inner // m_heads if get("mamba_d_head") == "auto" else int(get("mamba_d_head"))
    if m_head_dim * m_heads != inner:
        raise ValueError(f"{where}: mamba_d_head={m_head_dim} x mamba_n_heads={m_heads} must equal the mixer's width "
                         f"{inner} (mamba_d_ssm, or mamba_expand x hidden_size)")
    gate, down = (float(v) for v in (get("mlp_multipliers") or (1.0, 1.0)))
    parts = tuple(float(v) for v in (get("ssm_multipliers") or (1.0,) * 5))
    lo, hi = (_float(v) for v in get("time_step_limit"))
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta, scaling = rope_of(rope, hf, where, float(hf.get("rope_theta") or 10000.0))
    kv = get("num_key_value_heads")
    bias = bool(get("attention_bias"))
    norm = "none" if not get("mamba_rms_norm") else "before_gate" if get("mamba_norm_before_gate") else "gated"
    return Config(
        model_type=mt, vocab=int(get("vocab_size")), hidden=hidden, layers=layers, heads=heads,
        kv_heads=int(kv) if kv is not None else heads, mlp=int(get("intermediate_size")),
        head_dim=int(hf.get("head_dim") or hidden // heads), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(get("rms_norm_eps")), tie_embeddings=bool(get("tie_word_embeddings")),
        init_std=float(get("initializer_range")), max_seq=int(get("max_position_embeddings")), qkv_bias=bias,
        o_bias=bias, embedding_multiplier=float(get("embedding_multiplier")),
        logit_scale=float(get("lm_head_multiplier")), layer_blocks=(BLOCK,) * layers, mamba_heads=m_heads,
        mamba_head_dim=m_head_dim, mamba_groups=int(get("mamba_n_groups")), ssm_state=int(get("mamba_d_state")),
        conv_kernel=int(get("mamba_d_conv")), mamba_chunk=int(get("mamba_chunk_size")),
        mamba_dt_limit=None if (lo, hi) == (0.0, math.inf) else (lo, hi), mamba_conv_bias=bool(get("mamba_conv_bias")),
        mamba_in_multiplier=float(get("ssm_in_multiplier")),
        mamba_part_multipliers=None if parts == (1.0,) * 5 else parts,
        mamba_out_multiplier=float(get("ssm_out_multiplier")), mamba_norm=norm,
        attn_in_multiplier=float(get("attention_in_multiplier")),
        attn_out_multiplier=float(get("attention_out_multiplier")), key_multiplier=float(get("key_multiplier")),
        mlp_gate_multiplier=gate, mlp_down_multiplier=down)


_OWN = ("layer_blocks", "mamba_heads", "mamba_in_multiplier", "mamba_part_multipliers", "mamba_out_multiplier",
        "mamba_norm", "attn_in_multiplier", "attn_out_multiplier", "key_multiplier", "mlp_gate_multiplier",
        "mlp_down_multiplier", "embedding_multiplier", "logit_scale")


def check_exportable(cfg: Config, plain: dict[str, Any], error: type = ValueError) -> None:
    """Refuse (``error``, naming the field) a config ``FalconH1ForCausalLM`` cannot hold; ``plain``: the
    switches' values in Llama."""
    where, arch = f"export as {cfg.model_type!r}", ARCHITECTURES["falcon_h1"]
    need = {k: v for k, v in plain.items() if k not in _OWN}
    need.update(o_bias=cfg.qkv_bias, qk_norm=False, norm_offset=0.0, scale_embeddings=False, mlp_act="silu",
                query_pre_attn_scalar=None, attn_softcap=None, final_softcap=None, sliding_window=None,
                mamba_proj_bias=False, experts=0)
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs {want!r}); choose "
                        f"another model_type")
    if cfg.layer_blocks != (BLOCK,) * cfg.layers:
        raise error(f"{where}: layer_blocks={cfg.layer_blocks} has no {arch} equivalent (every layer {BLOCK!r})")
    if cfg.rope_scaling is not None:
        raise error(f"{where}: rope_scaling {type(cfg.rope_scaling).__name__} is not exported for falcon_h1 (only "
                    f"the default rope)")


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """The ``FalconH1ForCausalLM`` ``config.json`` of ``cfg`` (checked by :func:`check_exportable` before)."""
    dname = str(dtype).removeprefix("torch.")
    m = cfg.mamba
    limit = list(cfg.mamba_dt_limit) if cfg.mamba_dt_limit is not None else [0.0, math.inf]
    return {"architectures": [ARCHITECTURES["falcon_h1"]], "model_type": "falcon_h1", "vocab_size": cfg.vocab,
            "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_head,
            "hidden_act": "silu", "initializer_range": cfg.init_std, "rms_norm_eps": cfg.norm_eps,
            "max_position_embeddings": cfg.max_seq, "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
            "attention_bias": cfg.qkv_bias, "mlp_bias": False, "projectors_bias": False, "mamba_proj_bias": False,
            "mamba_d_ssm": m.inner, "mamba_n_heads": m.heads, "mamba_d_head": m.head_dim, "mamba_n_groups": m.groups,
            "mamba_d_state": m.state, "mamba_d_conv": m.conv_kernel, "mamba_chunk_size": m.chunk,
            "mamba_conv_bias": m.conv_bias, "mamba_rms_norm": m.norm != "none",
            "mamba_norm_before_gate": m.norm == "before_gate",
            "time_step_limit": [v if math.isfinite(v) else {"__float__": "Infinity"} for v in limit],
            "embedding_multiplier": cfg.embedding_multiplier, "lm_head_multiplier": cfg.logit_scale,
            "ssm_in_multiplier": m.in_scale, "ssm_multipliers": list(m.part_scales),
            "ssm_out_multiplier": cfg.mamba_out_multiplier, "attention_in_multiplier": cfg.attn_in_multiplier,
            "attention_out_multiplier": cfg.attn_out_multiplier, "key_multiplier": cfg.key_multiplier,
            "mlp_multipliers": [cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier], "attention_dropout": 0.0,
            "dtype": dname, "torch_dtype": dname}
