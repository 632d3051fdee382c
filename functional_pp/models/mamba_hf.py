"""Mamba (v1) (``mamba``: ``MambaForCausalLM``; Axolotl's ``model_type: MambaLMHeadModel``) as a
configuration of the one decoder (docs/models.md, "Decoder families"): layers of one block each,
a Mamba (v1) mixer after an RMSNorm (``layer_blocks`` ``mamba1``, models/mamba1.py), no attention, no
MLP, tied embeddings by default; the files under ``backbone.`` (``embeddings``, ``layers.{i}.norm``,
``layers.{i}.mixer``, ``norm_f``), as transformers' modules are named.

``config.json`` <-> :class:`~functional_pp.models.llama.Config` (:func:`config_from_hf`,
:func:`config_to_hf`, :func:`check_exportable`); the tensor names are the table's with :data:`RENAMED`."""
from __future__ import annotations

import math
from typing import Any

import torch

from functional_pp.models.llama import Config

__all__ = ["ARCHITECTURES", "DEFAULTS", "RENAMED", "TABLE", "config_from_hf", "config_to_hf", "check_exportable"]

ARCHITECTURES: dict[str, str] = {"mamba": "MambaForCausalLM"}

_M = "model.layers.{i}.mamba1"
_OURS = "layers.{i}.mamba1"
TABLE: tuple[tuple[str, str, str], ...] = (
    (f"{_M}.in_proj.weight", f"{_OURS}.in_proj", "heads_out"), (f"{_M}.in_proj.bias", f"{_OURS}.in_bias", "bias_heads"),
    (f"{_M}.conv1d.weight", f"{_OURS}.conv", "depthwise"), (f"{_M}.conv1d.bias", f"{_OURS}.conv_bias", "copy"),
    (f"{_M}.x_proj.weight", f"{_OURS}.x_proj", "linear"), (f"{_M}.dt_proj.weight", f"{_OURS}.dt_proj", "linear"),
    (f"{_M}.dt_proj.bias", f"{_OURS}.dt_bias", "copy"), (f"{_M}.A_log", f"{_OURS}.A_log", "copy"),
    (f"{_M}.D", f"{_OURS}.D", "copy"), (f"{_M}.out_proj.weight", f"{_OURS}.out_proj", "linear"),
    (f"{_M}.out_proj.bias", f"{_OURS}.out_bias", "copy"),
    *((f"{_M}.{k}_layernorm.weight", f"{_OURS}.{k}_norm", "copy") for k in ("dt", "b", "c")))
"""``(HF name, our path, kind)`` of a Mamba (v1) mixer's parameters (:data:`functional_pp.models.llama_hf`'s
table; Mamba's files rename ``model.layers.{i}.mamba1`` to ``backbone.layers.{i}.mixer``, Jamba's to
``model.layers.{i}.mamba``): ``in_proj`` holds x then z along its rows, ``x_proj`` the time step, B and C."""

RENAMED: tuple[tuple[str, str], ...] = (
    (r"^model\.embed_tokens\.", "backbone.embeddings."), (r"^model\.norm\.", "backbone.norm_f."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"backbone.layers.\1.norm."),
    (r"^model\.layers\.(\d+)\.mamba1\.", r"backbone.layers.\1.mixer."))
"""Mamba's tensor names beside the table's: one norm and one mixer per layer, under ``backbone.``."""

DEFAULTS: dict[str, Any] = dict(
    vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=32, layer_norm_epsilon=1e-5, expand=2,
    conv_kernel=4, use_bias=False, use_conv_bias=True, hidden_act="silu", initializer_range=0.1,
    residual_in_fp32=True, time_step_rank="auto", tie_word_embeddings=True, intermediate_size=None)
"""``MambaConfig``'s defaults of the keys read here (a config.json may leave them out)."""


def config_from_hf(hf: dict, mt: str) -> Config:
    """``Config`` of a ``mamba`` ``config.json``; a ValueError names what the decoder cannot reproduce.
    ``residual_in_fp32`` is read and ignored: in float32 (and float64) it changes nothing; under bf16 the
    residual stream stays in the compute dtype (transformers keeps it in float32)."""
    where = f"HF {mt} config"

    def get(key: str) -> Any:
        v = hf.get(key)
        return DEFAULTS.get(key) if v is None else v
    if get("hidden_act") != "silu":
        raise ValueError(f"{where}: hidden_act={get('hidden_act')!r} is not supported (only 'silu')")
    hidden = int(get("hidden_size"))
    inner = int(hf.get("intermediate_size") or int(get("expand")) * hidden)
    rank = get("time_step_rank")
    rank = math.ceil(hidden / 16) if rank == "auto" else int(rank)
    layers = int(get("num_hidden_layers"))
    return Config(model_type=mt, vocab=int(get("vocab_size")), hidden=hidden, layers=layers, heads=1, kv_heads=1,
                  mlp=inner, rope_scaling=None, norm_eps=float(get("layer_norm_epsilon")),
                  tie_embeddings=bool(get("tie_word_embeddings")), init_std=float(get("initializer_range")),
                  # (no positions, so no length it was built for: 0, no limit on sequence_len)
                  max_seq=int(hf.get("max_position_embeddings") or 0), layer_blocks=("mamba1",) * layers,
                  mamba1_inner=inner, mamba1_dt_rank=rank, ssm_state=int(get("state_size")),
                  conv_kernel=int(get("conv_kernel")), mamba_conv_bias=bool(get("use_conv_bias")),
                  mamba_proj_bias=bool(get("use_bias")))


def check_exportable(cfg: Config, plain: dict[str, Any], error: type = ValueError) -> None:
    """Refuse (``error``, naming the field) a config ``MambaForCausalLM`` cannot hold."""
    where, arch = f"export as {cfg.model_type!r}", ARCHITECTURES["mamba"]
    if cfg.layer_blocks != ("mamba1",) * cfg.layers or cfg.mamba1_dt_norms or cfg.experts:
        raise error(f"{where}: layer_blocks={cfg.layer_blocks}, mamba1_dt_norms={cfg.mamba1_dt_norms}, "
                    f"experts={cfg.experts}: {arch}'s layers are a Mamba (v1) mixer each (layer_blocks 'mamba1' "
                    f"in every layer, no dt/B/C norms, no experts); choose another model_type")
    need = {k: v for k, v in plain.items() if k not in ("layer_blocks", "mamba1_inner", "mamba1_dt_rank")}
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs {want!r}); choose "
                        f"another model_type")


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """The ``MambaForCausalLM`` ``config.json`` of ``cfg`` (checked by :func:`check_exportable` before)."""
    dname = str(dtype).removeprefix("torch.")
    m = cfg.mamba1
    return {"architectures": [ARCHITECTURES["mamba"]], "model_type": "mamba", "vocab_size": cfg.vocab,
            "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "intermediate_size": m.inner,
            "expand": m.inner // cfg.hidden if m.inner % cfg.hidden == 0 else 2, "state_size": m.state,
            "time_step_rank": m.dt_rank, "conv_kernel": m.conv_kernel, "use_conv_bias": m.conv_bias,
            "use_bias": m.proj_bias, "hidden_act": "silu", "layer_norm_epsilon": cfg.norm_eps,
            "initializer_range": cfg.init_std, "residual_in_fp32": True, "tie_word_embeddings": cfg.tie_embeddings,
            "dtype": dname, "torch_dtype": dname}
