"""IBM's Granite 4 hybrid (``granitemoehybrid``: ``GraniteMoeHybridForCausalLM``) as a configuration
of the one decoder (docs/models.md, "Decoder families"): Granite's layer (its embedding, residual,
attention and logit multipliers) whose token mixer is a Mamba2 mixer (``layer_types``
``mamba`` / ``linear_attention``; models/mamba2.py) or attention (``attention`` / ``full_attention``), then
the shared MLP (``shared_mlp``: gated, gate and up fused in ``input_linear``) plus, with
``num_local_experts`` > 0, Granite MoE's experts (``block_sparse_moe``); the rotary only with
``position_embedding_type: rope`` (else every layer NoPE).

``config.json`` <-> :class:`~functional_pp.models.llama.Config` (:func:`config_from_hf`,
:func:`config_to_hf`, :func:`check_exportable`): the Granite (dense) or Granite MoE shared reader
and writer of the decoder's tables (``read`` / ``write``: ``llama_hf.config_from_hf_dict`` /
``config_to_hf``), the hybrid's keys on top; the tensor names are Granite MoE shared's with
:data:`RENAMED` (the dense MLP as ``shared_mlp``) and the mixers' (models/mamba2_hf.py)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from functional_pp.models.llama import Config

__all__ = ["ARCHITECTURES", "RENAMED", "config_from_hf", "config_to_hf", "check_exportable"]

ARCHITECTURES: dict[str, str] = {"granitemoehybrid": "GraniteMoeHybridForCausalLM"}

RENAMED: tuple[tuple[str, str], ...] = (
    (r"\.mlp\.down_proj\.", ".shared_mlp.output_linear."), (r"\.mlp\.(gate|up)_proj\.", r".shared_mlp.\1_proj."))
"""The dense MLP's names (a model without experts: its shared MLP alone), beside Granite MoE shared's."""

FUSED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model.layers.{i}.shared_mlp.input_linear.weight",
     ("model.layers.{i}.shared_mlp.gate_proj.weight", "model.layers.{i}.shared_mlp.up_proj.weight")),)
"""The dense MLP's gate and up, fused as the shared expert's (names after the renames)."""

BLOCKS = {"mamba": "mamba2+mlp", "linear_attention": "mamba2+mlp", "attention": "attention+mlp",
          "full_attention": "attention+mlp"}
_HYBRID_KEYS = ("layer_types", "layers_block_type", "position_embedding_type", "time_step_limit", "mamba_n_heads",
                "mamba_n_groups", "mamba_d_state", "mamba_d_head", "mamba_d_conv", "mamba_expand", "mamba_chunk_size",
                "mamba_conv_bias", "mamba_proj_bias", "shared_intermediate_size", "num_local_experts")
DEFAULTS: dict[str, Any] = dict(hidden_size=4096, num_hidden_layers=32, hidden_act="silu", num_local_experts=8,
                                shared_intermediate_size=1024, position_embedding_type=None, mamba_n_heads=128,
                                mamba_n_groups=1, mamba_d_state=256, mamba_d_head="auto", mamba_d_conv=4,
                                mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
                                time_step_limit=(0.0, math.inf), rms_norm_eps=1e-6)
"""``GraniteMoeHybridConfig``'s defaults of the keys read here."""


def _float(v: Any) -> float:
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def config_from_hf(hf: dict, mt: str, read: Callable[[dict], Config]) -> Config:
    """``Config`` of a ``granitemoehybrid`` ``config.json``; ``read`` the decoder's reader of a
    ``granite`` / ``granitemoeshared`` one. A ValueError names what the decoder cannot reproduce."""
    where = f"HF {mt} config"

    def get(key: str) -> Any:
        v = hf.get(key)
        return DEFAULTS.get(key) if v is None else v
    layers, hidden = int(get("num_hidden_layers")), int(get("hidden_size"))
    types = list(hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * layers)
    bad = sorted(set(types) - set(BLOCKS))
    if bad or len(types) != layers:
        raise ValueError(f"{where}: layer_types {types} must be {layers} entries of mamba / attention "
                         f"(linear_attention / full_attention)")
    if get("position_embedding_type") not in (None, "nope", "rope"):
        raise ValueError(f"{where}: position_embedding_type={get('position_embedding_type')!r} is not supported "
                         f"(only rope, or none)")
    if get("mamba_proj_bias"):
        raise ValueError(f"{where}: mamba_proj_bias=True is not supported (only False)")
    if get("hidden_act") != "silu":
        raise ValueError(f"{where}: hidden_act={get('hidden_act')!r} is not supported (only 'silu')")
    inner = int(get("mamba_expand")) * hidden
    heads = int(get("mamba_n_heads"))
    head_dim = inner // heads if get("mamba_d_head") == "auto" else int(get("mamba_d_head"))
    if head_dim * heads != inner:
        raise ValueError(f"{where}: mamba_d_head={head_dim} x mamba_n_heads={heads} must equal mamba_expand x "
                         f"hidden_size = {inner}")
    experts = int(get("num_local_experts") or 0)
    base = {k: v for k, v in hf.items() if k not in _HYBRID_KEYS}
    if experts:
        base.update(model_type="granitemoeshared", num_local_experts=experts,
                    shared_intermediate_size=int(get("shared_intermediate_size")))
    else:
        base.update(model_type="granite", intermediate_size=int(get("shared_intermediate_size")))
    base.setdefault("rms_norm_eps", DEFAULTS["rms_norm_eps"])
    cfg = read(base)
    lo, hi = (_float(v) for v in get("time_step_limit"))
    return dataclasses.replace(
        cfg, model_type=mt, layer_blocks=tuple(BLOCKS[t] for t in types),
        nope_layers=None if get("position_embedding_type") == "rope" else tuple(range(layers)),
        mamba_heads=heads, mamba_head_dim=head_dim, mamba_groups=int(get("mamba_n_groups")),
        ssm_state=int(get("mamba_d_state")), conv_kernel=int(get("mamba_d_conv")),
        mamba_chunk=int(get("mamba_chunk_size")), mamba_conv_bias=bool(get("mamba_conv_bias")),
        mamba_dt_limit=None if (lo, hi) == (0.0, math.inf) else (lo, hi))


def as_granite(cfg: Config) -> Config:
    """The Granite (dense) or Granite MoE shared config of ``cfg``'s attention, MLPs and multipliers."""
    return dataclasses.replace(cfg, model_type="granitemoeshared" if cfg.experts else "granite", layer_blocks=None,
                               mamba_heads=0, nope_layers=None)


def check_exportable(cfg: Config, check: Callable[[Config], None], error: type = ValueError) -> None:
    """Refuse (``error``) a config ``GraniteMoeHybridForCausalLM`` cannot hold; ``check`` the
    decoder's check of a Granite / Granite MoE shared config."""
    where, arch = f"export as {cfg.model_type!r}", ARCHITECTURES["granitemoehybrid"]
    blocks = cfg.layer_blocks or ("attention+mlp",) * cfg.layers
    bad = sorted(set(blocks) - {"mamba2+mlp", "attention+mlp"})
    if bad:
        raise error(f"{where}: layer_blocks entries {bad} have no {arch} equivalent (its layers: mamba2+mlp or "
                    f"attention+mlp)")
    if cfg.nope_layers not in (None, tuple(range(cfg.layers))):
        raise error(f"{where}: nope_layers={cfg.nope_layers} has no {arch} equivalent (the rotary in every layer "
                    f"or in none: position_embedding_type)")
    if cfg.experts and cfg.shared_expert_mlp < 1:
        raise error(f"{where}: experts without a shared expert have no {arch} equivalent (its shared_mlp)")
    if cfg.mamba_proj_bias:
        raise error(f"{where}: mamba_proj_bias=True has no {arch} equivalent here (only False)")
    check(as_granite(cfg))


def config_to_hf(cfg: Config, write: Callable[[Config, torch.dtype], dict], dtype: torch.dtype = torch.float32) -> dict:
    """The ``GraniteMoeHybridForCausalLM`` ``config.json`` of ``cfg`` (checked by :func:`check_exportable`)."""
    out = write(as_granite(cfg), dtype)
    names = {"mamba2+mlp": "mamba", "attention+mlp": "attention"}
    m = cfg.mamba
    limit = list(cfg.mamba_dt_limit) if cfg.mamba_dt_limit is not None else [0.0, math.inf]
    out.update(architectures=[ARCHITECTURES["granitemoehybrid"]], model_type="granitemoehybrid",
               layer_types=[names[b] for b in (cfg.layer_blocks or ("attention+mlp",) * cfg.layers)],
               position_embedding_type="nope" if cfg.nope_layers else "rope",
               num_local_experts=cfg.experts,
               shared_intermediate_size=cfg.shared_expert_mlp if cfg.experts else cfg.mlp)
    if not cfg.experts:
        out["intermediate_size"] = cfg.mlp
    if m is not None:
        out.update(mamba_n_heads=m.heads, mamba_d_head=m.head_dim, mamba_n_groups=m.groups, mamba_d_state=m.state,
                   mamba_d_conv=m.conv_kernel, mamba_expand=m.inner // cfg.hidden, mamba_chunk_size=m.chunk,
                   mamba_conv_bias=m.conv_bias, mamba_proj_bias=False,
                   time_step_limit=[v if math.isfinite(v) else {"__float__": "Infinity"} for v in limit])
    return out
