"""Hugging Face names and config of a multimodal Gemma 4 checkpoint's vision side
(models/gemma4_vision.py): ``model.vision_tower.`` (``Gemma4VisionModel``: its linears each a
``Gemma4ClippableLinear`` holding ``.linear``) and ``model.embed_vision.`` (the embedder) tensors,
and the :class:`~functional_pp.models.gemma4_vision.Gemma4VisionConfig` of its ``config.json``.
The audio tower and its embedder stay unread (models/gemma4_hf.py's ``IGNORED``)."""
from __future__ import annotations

import dataclasses
from typing import Callable

from functional_pp.models.gemma4_vision import ACTIVATIONS, Gemma4VisionConfig
from functional_pp.models.llama import Config
from functional_pp.models.multimodal_hf import wrapped_config

_LAYER = "vision_tower.encoder.layers.{i}."
_OURS = "vision_tower.encoder.{i}."
TABLE = (
    ("vision_tower.patch_embedder.input_proj.weight", "vision_tower.input_proj", "linear"),
    ("vision_tower.patch_embedder.position_embedding_table", "vision_tower.position_table", "copy"),
    *((_LAYER + f"{n}.weight", _OURS + n, "copy")
      for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")),
    *((_LAYER + f"self_attn.{x}_proj.linear.weight", _OURS + f"self_attn.{x}_proj", "heads_out") for x in "qkv"),
    (_LAYER + "self_attn.o_proj.linear.weight", _OURS + "self_attn.o_proj", "heads_in"),
    *((_LAYER + f"self_attn.{x}_norm.weight", _OURS + f"self_attn.{x}_norm", "copy") for x in "qk"),
    *((_LAYER + f"mlp.{x}_proj.linear.weight", _OURS + f"mlp.{x}_proj", "linear") for x in ("gate", "up", "down")),
    ("embed_vision.embedding_projection.weight", "multi_modal_projector.embedding_projection", "linear"),
)
"""``(HF name pattern, our path pattern, transform kind)`` rows of the decoder table (llama_hf.LLAMA_TABLE);
the names before :data:`RENAMED` (``model.``)."""

RENAMED = ((r"^(vision_tower|embed_vision)\.", r"model.\1."),)
"""The tower and the embedder live under ``model.`` (after the text decoder's ``model.language_model.``)."""

WRAPPERS = ("gemma4",)
"""The multimodal ``model_type`` whose images this module reads."""

CLASS = "Gemma4ForConditionalGeneration"


def vision_from_hf(hf: dict) -> Gemma4VisionConfig:
    """The vision tower of a multimodal ``gemma4`` ``config.json``, refusing by name what the functional
    tower does not reproduce."""
    where = f"HF {hf.get('model_type')} config"
    v = dict(hf.get("vision_config") or {})
    if not v:
        raise ValueError(f"{where}: no vision_config (a checkpoint without a vision tower): train it on text "
                         f"(drop processor_type and the image columns)")
    text = hf.get("text_config") or {}
    rope = v.get("rope_parameters") or {}
    heads = v.get("num_attention_heads", 12)
    checks = {"vision_config.use_clipped_linears": (bool(v.get("use_clipped_linears", False)), False),
              "vision_config.standardize": (bool(v.get("standardize", False)), False),
              "vision_config.num_key_value_heads": (v.get("num_key_value_heads", heads), heads),
              "vision_config.attention_bias": (bool(v.get("attention_bias", False)), False),
              "vision_config.attention_dropout": (float(v.get("attention_dropout") or 0.0), 0.0),
              "vision_config.rope_parameters.rope_type": (rope.get("rope_type", "axial"), "axial"),
              "text_config.hidden_size_per_layer_input (with images)": (
                  int(text.get("hidden_size_per_layer_input", 256) or 0), 0)}
    for key, (have, want) in checks.items():
        if have != want:
            raise ValueError(f"{where}: {key}={have!r} is not supported with images yet (the functional tower has "
                             f"{want!r}); train this checkpoint on text (drop processor_type and the image columns)")
    act = v.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: vision_config.hidden_activation={act!r} is not supported "
                         f"({', '.join(ACTIVATIONS)})")
    return Gemma4VisionConfig(hidden=v.get("hidden_size", 768), layers=v.get("num_hidden_layers", 16), heads=heads,
                              head_dim=v.get("head_dim", 64), mlp=v.get("intermediate_size", 3072),
                              patch_size=v.get("patch_size", 16), pool=v.get("pooling_kernel_size", 3),
                              positions=v.get("position_embedding_size", 10 * 1024),
                              rope_theta=float(rope.get("rope_theta", 100.0)), norm_eps=v.get("rms_norm_eps", 1e-6),
                              hidden_act=act, image_token_id=hf.get("image_token_id", 258_880),
                              boi_token_id=hf.get("boi_token_id", 255_999),
                              eoi_token_id=hf.get("eoi_token_id", 258_882))


def config_to_hf(cfg: Config, write: Callable[[Config], dict]) -> dict:
    """The multimodal ``gemma4`` ``config.json`` of ``cfg`` around its text decoder's (``write``'s: a
    ``gemma4_text`` one) and its tower's (no audio tower)."""
    v = cfg.vision
    text = write(dataclasses.replace(cfg, vision=None, model_type="gemma4_text"))
    vision = {"model_type": "gemma4_vision", "hidden_size": v.hidden, "intermediate_size": v.mlp,
              "num_hidden_layers": v.layers, "num_attention_heads": v.heads, "num_key_value_heads": v.heads,
              "head_dim": v.head_dim, "hidden_activation": v.hidden_act, "rms_norm_eps": v.norm_eps,
              "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
              "pooling_kernel_size": v.pool, "patch_size": v.patch_size, "position_embedding_size": v.positions,
              "use_clipped_linears": False, "standardize": False}
    return wrapped_config("gemma4", CLASS, text, vision, True, audio_config=None, image_token_id=v.image_token_id,
                          boi_token_id=v.boi_token_id, eoi_token_id=v.eoi_token_id)
