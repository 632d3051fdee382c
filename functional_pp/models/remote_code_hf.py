"""Checkpoints whose modelling code is not in transformers but in their repository
(``trust_remote_code: true``), each read onto a family this decoder already has, its math
unchanged: only its ``config.json`` keys and its tensor names differ (docs/models.md, "Remote code").

- Qwen (v1) (``model_type: qwen``, ``QWenLMHeadModel``): Qwen2's layer (q/k/v biases, no output
  bias, RMSNorm, SwiGLU, rotate-half rotary). Files under ``transformer.``: ``wte``, ``h.{i}.ln_1``,
  ``attn.c_attn`` (q, k and v fused along the rows, weight and bias), ``attn.c_proj``, ``ln_2``,
  ``mlp.w1`` (up: ``QWenMLP`` is ``c_proj(w1(x) * silu(w2(x)))``, so ``w2`` is the gate),
  ``mlp.w2``, ``mlp.c_proj`` (down), ``ln_f``; ``lm_head``. ``intermediate_size`` counts both
  halves (the MLP's width is half of it), ``kv_channels`` is the head width, ``rotary_emb_base`` the
  rotary base. ``use_dynamic_ntk`` / ``use_logn_attn`` act only in inference past ``seq_length``
  (the remote model applies neither in training), so the positions are ``seq_length`` when either is on.
- MiMo (``model_type: mimo``, ``MiMoForCausalLM``): Qwen2's decoder and names, plus
  ``num_nextn_predict_layers`` multi-token-prediction layers (``model.mtp_layers.{j}``) that the
  remote model's forward never calls (its ``MiMoForCausalLM`` is ``Qwen2ForCausalLM``'s forward): they
  are not read, not trained, and copied unchanged into an export (checkpoint/hf_unheld.py).

- Replit's MPT (``replit/replit-code-v1-3b``: ``model_type: mpt`` with ``auto_map``, its remote
  ``MPTForCausalLM``): transformers' MPT (ALiBi, bias-free LayerNorms, ``attn.Wqkv``,
  ``attn.out_proj``, a GELU MLP, tied embeddings) under other module names, as its original Hub
  files hold them (ggml's Replit example reads them so): ``transformer.blocks.{i}.ln_1`` / ``ln_2``,
  ``mlp.mlp_up`` / ``mlp.mlp_down``, ``transformer.ln_f``.
  ``config.json`` cannot tell it from MosaicML's later remote MPTs (whose names are transformers'),
  so the files do: a checkpoint of ``model_type: mpt`` holding ``mlp.mlp_up`` reads as the internal
  family ``replit_mpt`` (:func:`with_file_layout`), whose export writes ``model_type: mpt``, Replit's
  class and ``auto_map``, and its names back; LoRA targets written with its module names
  (``mlp_up``) are its weights.

Each is the :class:`~functional_pp.models.hf_switches.Switches` record of its ``model_type``, with
:data:`RENAMED` / :data:`FUSED` its files' names and :data:`IGNORED` the tensors it does not read."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from functional_pp.models.hf_switches import SWITCHES as _DECODER_SWITCHES
from functional_pp.models.hf_switches import Get, Switches

__all__ = ["SWITCHES", "RENAMED", "FUSED", "IGNORED", "AUTO_MAP", "FILE_LAYOUTS", "with_file_layout", "tensor_names"]

AUTO_MAP: dict[str, dict[str, str]] = {
    "replit_mpt": {"AutoConfig": "configuration_mpt.MPTConfig", "AutoModelForCausalLM": "modeling_mpt.MPTForCausalLM"},
    "qwen": {"AutoConfig": "configuration_qwen.QWenConfig", "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "mimo": {"AutoConfig": "configuration_mimo.MiMoConfig", "AutoModel": "modeling_mimo.MiMoModel",
             "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"},
}
"""Per model type, the ``auto_map`` of its hub ``config.json`` (the remote classes), written on export."""

# the shared keys (llama_hf's) that an exported config.json of these families does not carry
_LLAMA_KEYS = ("num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "attention_dropout", "attention_bias",
               "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings", "intermediate_size",
               "pad_token_id")


# --------------------------------------------------------------------------- Qwen (v1)
_QWEN_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      emb_dropout_prob=0.0, attn_dropout_prob=0.0, layer_norm_epsilon=1e-6, initializer_range=0.02,
                      max_position_embeddings=8192, seq_length=8192, scale_attn_weights=True, kv_channels=128,
                      rotary_pct=1.0, rotary_emb_base=10000, use_dynamic_ntk=True, use_logn_attn=True,
                      intermediate_size=22016, no_bias=True, tie_word_embeddings=False)
"""``QWenConfig``'s defaults (configuration_qwen.py) of the keys read."""


def _qwen_prepare(hf: dict) -> dict:
    """Qwen (v1)'s config.json keys as the shared ones (QWenConfig's defaults where left out)."""
    d = {**_QWEN_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    heads = int(d["num_attention_heads"])
    return dict(hf, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=heads,
                intermediate_size=int(d["intermediate_size"]) // 2,
                rms_norm_eps=d["layer_norm_epsilon"], rope_theta=float(d["rotary_emb_base"]), hidden_act="silu",
                attention_dropout=d["attn_dropout_prob"], max_position_embeddings=d["max_position_embeddings"],
                tie_word_embeddings=d["tie_word_embeddings"])


def _qwen_read(hf: dict, get: Get, where: str) -> dict:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    for key, ok in (("no_bias", True), ("scale_attn_weights", True), ("rotary_pct", 1.0), ("emb_dropout_prob", 0.0)):
        if get(key) != ok:
            raise ValueError(f"{where}: {key}={get(key)!r} is not supported (only {ok!r}: Qwen-7B / 14B / 72B's "
                             f"QWenLMHeadModel)")
    if int(get("kv_channels")) * heads != hidden:   # (its attention splits c_attn in three of hidden_size)
        raise ValueError(f"{where}: kv_channels={get('kv_channels')} x num_attention_heads={heads} must equal "
                         f"hidden_size={hidden} (QWenAttention splits c_attn's rows in three of hidden_size)")
    if hf.get("rope_scaling") or hf.get("rope_parameters"):
        raise ValueError(f"{where}: rope_scaling={hf.get('rope_scaling') or hf.get('rope_parameters')!r} is not "
                         f"supported (Qwen (v1) has rotary_emb_base and its inference-only dynamic NTK)")
    # (dynamic NTK and log-n scaling: inference past seq_length only; within it, and in training, plain attention)
    extends = bool(get("use_dynamic_ntk")) or bool(get("use_logn_attn"))
    return dict(max_seq=int(get("seq_length")) if extends else int(get("max_position_embeddings")))


def _qwen_write(cfg, out: dict) -> None:
    for key in _LLAMA_KEYS:
        out.pop(key, None)
    out.update(auto_map=AUTO_MAP["qwen"], intermediate_size=2 * cfg.mlp, kv_channels=cfg.dim_head,
               layer_norm_epsilon=cfg.norm_eps, rotary_emb_base=cfg.rope_theta, rotary_pct=1.0,
               seq_length=cfg.max_seq, max_position_embeddings=cfg.max_seq, use_dynamic_ntk=True, use_logn_attn=True,
               no_bias=True, scale_attn_weights=True, emb_dropout_prob=0.0, attn_dropout_prob=cfg.attention_dropout,
               use_flash_attn="auto", bf16=False, fp16=False, fp32=False)
    # (no tokenizer_class: the export's tokenizer is a tokenizer.json, not the remote QWenTokenizer)


# --------------------------------------------------------------------------- MiMo
def _mimo_read(hf: dict, get: Get, where: str) -> dict:
    if get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=True is not supported (MiMo's published configs attend "
                         f"over every position)")
    return dict(mtp_layers=int(get("num_nextn_predict_layers") or 0))


def _mimo_write(cfg, out: dict) -> None:
    out.pop("attention_bias", None)
    types = ["full_attention"] * cfg.layers
    out.update(auto_map=AUTO_MAP["mimo"], num_nextn_predict_layers=cfg.mtp_layers, use_sliding_window=False,
               sliding_window=None, max_window_layers=cfg.layers, layer_types=types)


# --------------------------------------------------------------------------- Replit's MPT
def _replit_write(cfg, out: dict) -> None:
    _DECODER_SWITCHES["mpt"].write(cfg, out)
    out.update(model_type="mpt", auto_map=AUTO_MAP["replit_mpt"], norm_type="low_precision_layernorm")


SWITCHES: dict[str, Switches] = {
    "replit_mpt": dataclasses.replace(_DECODER_SWITCHES["mpt"], architecture="MPTForCausalLM", write=_replit_write),
    "qwen": Switches("QWenLMHeadModel", _QWEN_DEFAULTS, _qwen_read, _qwen_write, prepare=_qwen_prepare,
                     free=("attention_dropout",),
                     fixed=dict(qkv_bias=True, o_bias=False, head_dim=None, kv_heads=lambda cfg: cfg.heads,
                                rope_scaling=None)),
    "mimo": Switches("MiMoForCausalLM", dict(rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False,
                                             sliding_window=4096, max_window_layers=28, tie_word_embeddings=False,
                                             num_nextn_predict_layers=0),
                     _mimo_read, _mimo_write, free=("mtp_layers",), fixed=dict(qkv_bias=True, o_bias=False)),
}
"""The remote-code families as switches of the decoder (merged into ``hf_switches.SWITCHES``)."""

RENAMED: dict[str, tuple[tuple[str, str], ...]] = {
    # Qwen (v1): transformer.h.{i}, ln_1 / ln_2, attn.c_attn (fused) / c_proj, mlp.w1 (up) / w2 (gate) / c_proj,
    # wte, ln_f
    "qwen": ((r"^model\.embed_tokens\.", "transformer.wte."), (r"^model\.layers\.", "transformer.h."),
             (r"\.input_layernorm\.", ".ln_1."), (r"\.post_attention_layernorm\.", ".ln_2."),
             (r"\.self_attn\.o_proj\.", ".attn.c_proj."), (r"\.self_attn\.", ".attn."),
             (r"\.mlp\.gate_proj\.", ".mlp.w2."), (r"\.mlp\.up_proj\.", ".mlp.w1."),
             (r"\.mlp\.down_proj\.", ".mlp.c_proj."), (r"^model\.norm\.", "transformer.ln_f.")),
    # Replit's MPT: transformer.blocks.{i}, ln_1 / ln_2, attn.Wqkv (fused) / out_proj, mlp.mlp_up / mlp_down,
    # wte, ln_f
    "replit_mpt": ((r"^model\.embed_tokens\.", "transformer.wte."), (r"^model\.layers\.", "transformer.blocks."),
                   (r"\.input_layernorm\.", ".ln_1."), (r"\.post_attention_layernorm\.", ".ln_2."),
                   (r"\.self_attn\.o_proj\.", ".attn.out_proj."), (r"\.self_attn\.", ".attn."),
                   (r"\.mlp\.up_proj\.", ".mlp.mlp_up."), (r"\.mlp\.down_proj\.", ".mlp.mlp_down."),
                   (r"^model\.norm\.", "transformer.ln_f.")),
}
"""Per model type, (pattern, replacement) of the decoder table's names in its files."""

FUSED: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "qwen": tuple((f"transformer.h.{{i}}.attn.c_attn.{t}",
                   tuple(f"transformer.h.{{i}}.attn.{x}_proj.{t}" for x in "qkv")) for t in ("weight", "bias")),
    "replit_mpt": (("transformer.blocks.{i}.attn.Wqkv.weight", tuple(f"transformer.blocks.{{i}}.attn.{x}_proj.weight"
                                                                      for x in "qkv")),),
}
"""Per model type, fused tensors (names after :data:`RENAMED`) and their parts along the rows."""

IGNORED: dict[str, tuple[str, ...]] = {"mimo": (r"model\.mtp_layers\..*",)}
"""Per model type, tensors of the files the decoder does not read (MiMo's multi-token-prediction layers)."""


FILE_LAYOUTS: dict[str, tuple[str, re.Pattern]] = {
    "replit_mpt": ("mpt", re.compile(r"^transformer\.blocks\.\d+\.mlp\.mlp_up\.weight$"))}
"""Internal family -> (the ``config.json`` ``model_type`` it shares, a tensor name only its files hold)."""


def tensor_names(folder: str | Path) -> list[str]:
    """The tensor names of a Hugging Face directory's safetensors (its index, or the single file's
    header); empty where it holds neither."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_text()).get("weight_map") or {})
        except (OSError, ValueError, AttributeError):
            return []
    single = folder / "model.safetensors"
    if not single.is_file():
        return []
    from safetensors import safe_open
    try:
        with safe_open(str(single), framework="pt") as f:
            return list(f.keys())
    except Exception:             # noqa: BLE001 - a damaged file: the loader names it when it reads the weights
        return []


def with_file_layout(hf: dict, folder: str | Path | None) -> dict:
    """``config.json``'s contents ``hf`` with ``model_type`` the internal family (:data:`FILE_LAYOUTS`)
    whose names the safetensors of ``folder`` hold (Replit's MPT: ``replit_mpt``); ``hf`` unchanged
    where none matches or there is no folder."""
    candidates = [(mt, marker) for mt, (base, marker) in FILE_LAYOUTS.items() if base == hf.get("model_type")]
    if not candidates or folder is None:
        return hf
    names = tensor_names(folder)
    return next((dict(hf, model_type=mt) for mt, marker in candidates if any(marker.match(n) for n in names)), hf)
