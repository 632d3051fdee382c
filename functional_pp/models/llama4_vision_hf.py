"""Hugging Face names and config of Llama 4's vision side (models/llama4_vision.py): the
``vision_model.`` tensors (``Llama4VisionModel``: its unfold convolution a linear, its adapter MLP
``vision_adapter.mlp``) and ``multi_modal_projector.linear_1``, and the
:class:`~functional_pp.models.llama4_vision.Llama4VisionConfig` of a ``llama4`` ``config.json``."""
from __future__ import annotations

import dataclasses
from typing import Callable

from functional_pp.models.llama import Config
from functional_pp.models.llama4_vision import Llama4VisionConfig
from functional_pp.models.multimodal_hf import wrapped_config

_LAYER = "vision_model.model.layers.{i}."
_OURS = "vision_tower.encoder_layers.{i}."
TABLE = (
    ("vision_model.patch_embedding.linear.weight", "vision_tower.patch_linear", "linear"),
    ("vision_model.class_embedding", "vision_tower.class_token", "copy"),
    ("vision_model.positional_embedding_vlm", "vision_tower.positional_embedding_vlm", "copy"),
    *((f"vision_model.{n}.{x}", f"vision_tower.{n}" + ("" if x == "weight" else "_bias"), "copy")
      for n in ("layernorm_pre", "layernorm_post") for x in ("weight", "bias")),
    *((_LAYER + f"{n}.{x}", _OURS + n + ("" if x == "weight" else "_bias"), "copy")
      for n in ("input_layernorm", "post_attention_layernorm") for x in ("weight", "bias")),
    *((_LAYER + f"self_attn.{x}_proj.weight", _OURS + f"self_attn.{x}_proj", "heads_out") for x in "qkv"),
    *((_LAYER + f"self_attn.{x}_proj.bias", _OURS + f"self_attn.{x}_bias", "bias_heads") for x in "qkv"),
    (_LAYER + "self_attn.o_proj.weight", _OURS + "self_attn.o_proj", "heads_in"),
    (_LAYER + "self_attn.o_proj.bias", _OURS + "self_attn.o_bias", "copy"),
    *((_LAYER + f"mlp.{x}.weight", _OURS + f"mlp.{x}", "linear") for x in ("fc1", "fc2")),
    *((_LAYER + f"mlp.{x}.bias", _OURS + f"mlp.{x}_bias", "copy") for x in ("fc1", "fc2")),
    *((f"vision_model.vision_adapter.mlp.{x}.weight", f"vision_tower.vision_adapter.mlp.{x}", "linear")
      for x in ("fc1", "fc2")),
)
"""``(HF name pattern, our path pattern, transform kind)`` rows of the decoder table (llama_hf.LLAMA_TABLE);
the projector's ``multi_modal_projector.linear_1`` is models/pixtral_hf.py's row."""

WRAPPERS = ("llama4",)
"""The multimodal ``model_type`` values whose images this module reads."""


def vision_from_hf(hf: dict) -> Llama4VisionConfig:
    """The vision model and projector of a ``llama4`` ``config.json``, refusing by name what the
    functional tower does not reproduce."""
    v = dict(hf.get("vision_config") or {})
    where = "HF llama4 config"
    hidden, mlp = v.get("hidden_size", 768), v.get("intermediate_size", 5632)
    ratio = float(v.get("pixel_shuffle_ratio", 0.5))
    merge = round(1 / ratio) if ratio > 0 else 0
    if merge < 1 or abs(merge * ratio - 1) > 1e-9:
        raise ValueError(f"{where}: vision_config.pixel_shuffle_ratio={ratio} is not supported (1 / an integer)")
    dims = {k: v.get(k, d) for k, d in (("projector_input_dim", 4096), ("projector_output_dim", 4096),
                                         ("vision_output_dim", 7680))}
    if len(set(dims.values())) != 1:
        raise ValueError(f"{where}: vision_config {dims} must be equal (the adapter MLP's fc2 is square and feeds "
                         f"multi_modal_projector.linear_1)")
    if mlp != hidden * merge ** 2:
        raise ValueError(f"{where}: vision_config.intermediate_size={mlp} must be hidden_size={hidden} x "
                         f"(1 / pixel_shuffle_ratio)² = {hidden * merge ** 2} (the pixel shuffle's width, which "
                         f"the adapter MLP reads)")
    checks = {"vision_config.hidden_act": (v.get("hidden_act", "gelu"), "gelu"),
              "vision_config.multi_modal_projector_bias": (bool(v.get("multi_modal_projector_bias", False)), False)}
    for key in ("image_size", "patch_size"):
        if isinstance(v.get(key), (list, tuple)):
            raise ValueError(f"{where}: vision_config.{key}={v[key]!r} is not supported (one size, square tiles)")
    for key, (have, want) in checks.items():
        if have != want:
            raise ValueError(f"{where}: {key}={have!r} is not supported (the functional tower has {want!r})")
    rope = v.get("rope_parameters") or {}
    return Llama4VisionConfig(hidden=hidden, layers=v.get("num_hidden_layers", 34),
                              heads=v.get("num_attention_heads", 16), mlp=mlp, patch_size=v.get("patch_size", 14),
                              channels=v.get("num_channels", 3), image_size=v.get("image_size", 448),
                              rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))), merge=merge,
                              projector_dim=dims["projector_output_dim"], norm_eps=v.get("norm_eps", 1e-5),
                              image_token_id=hf.get("image_token_index", 200092))


CLASSES = {"llama4": "Llama4ForConditionalGeneration"}
"""The multimodal class export writes."""


def config_to_hf(cfg: Config, write: Callable[[Config], dict]) -> dict:
    """The ``llama4`` ``config.json`` of ``cfg`` around its text decoder's (``write``'s: a
    ``Llama4ForCausalLM`` one) and its tower's."""
    v = cfg.vision
    text = write(dataclasses.replace(cfg, text_of=None, vision=None))
    d = v.projector_dim
    vision = {"model_type": "llama4_vision_model", "hidden_size": v.hidden, "num_hidden_layers": v.layers,
              "num_attention_heads": v.heads, "intermediate_size": v.mlp, "patch_size": v.patch_size,
              "num_channels": v.channels, "image_size": v.image_size, "hidden_act": "gelu", "norm_eps": v.norm_eps,
              "pixel_shuffle_ratio": 1 / v.merge, "projector_input_dim": d, "projector_output_dim": d,
              "vision_output_dim": d, "multi_modal_projector_bias": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": v.rope_theta}}
    return wrapped_config("llama4", CLASSES["llama4"], text, vision, False, image_token_index=v.image_token_id)
