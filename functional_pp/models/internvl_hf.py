"""Hugging Face names and config of an InternVL checkpoint (``InternVLForConditionalGeneration``, the
``-HF`` repositories; models/internvl.py): LLaVA's file layout (the Qwen decoder under
``language_model.``, ``vision_tower.``, ``multi_modal_projector.``), and the
:class:`~functional_pp.models.internvl.InternVLConfig` of its ``config.json``."""
from __future__ import annotations

import dataclasses
from typing import Callable

from functional_pp.models.internvl import InternVLConfig
from functional_pp.models.llama import Config
from functional_pp.models.multimodal_hf import wrapped_config

_LAYER = "vision_tower.encoder.layer.{i}."
TABLE = (
    ("vision_tower.embeddings.patch_embeddings.projection.weight", "vision_tower.embeddings.patch_embeddings", "copy"),
    ("vision_tower.embeddings.patch_embeddings.projection.bias", "vision_tower.embeddings.patch_embeddings_bias",
     "copy"),
    ("vision_tower.embeddings.cls_token", "vision_tower.embeddings.cls_token", "lead_2"),
    ("vision_tower.embeddings.position_embeddings", "vision_tower.embeddings.position_embeddings", "lead_1"),
    ("vision_tower.layernorm.weight", "vision_tower.layernorm", "copy"),
    ("vision_tower.layernorm.bias", "vision_tower.layernorm_bias", "copy"),
    *((_LAYER + f"layernorm_{hf}.{x}", _LAYER + f"layer_norm{j}{s}", "copy")
      for hf, j in (("before", 1), ("after", 2)) for x, s in (("weight", ""), ("bias", "_bias"))),
    *((_LAYER + f"attention.{x}_proj.weight", _LAYER + f"self_attn.{x}_proj", "heads_out") for x in "qkv"),
    *((_LAYER + f"attention.{x}_proj.bias", _LAYER + f"self_attn.{x}_bias", "bias_heads") for x in "qkv"),
    (_LAYER + "attention.projection_layer.weight", _LAYER + "self_attn.out_proj", "heads_in"),
    (_LAYER + "attention.projection_layer.bias", _LAYER + "self_attn.out_bias", "copy"),
    *((_LAYER + f"mlp.fc{j}.weight", _LAYER + f"mlp.fc{j}", "linear") for j in (1, 2)),
    *((_LAYER + f"mlp.fc{j}.bias", _LAYER + f"mlp.fc{j}_bias", "copy") for j in (1, 2)),
    *((_LAYER + f"lambda_{j}", _LAYER + f"lambda_{j}", "copy") for j in (1, 2)),
)
"""``(HF name pattern, our path pattern, transform kind)`` rows of the decoder table (llama_hf.LLAMA_TABLE;
the projector's are models/lfm2_vl_hf.py's and models/pixtral_hf.py's)."""

WRAPPER = "internvl"
WRAPPERS = (WRAPPER,)
TEXT = "qwen2"
"""The multimodal ``model_type`` this module reads and its text decoder's default family."""
CLASS = "InternVLForConditionalGeneration"


def vision_from_hf(hf: dict) -> InternVLConfig:
    """The tower and projector of an ``internvl`` ``config.json``, refusing by name what the functional
    tower does not reproduce."""
    v = dict(hf.get("vision_config") or {})
    where = "HF internvl config"
    text = hf.get("text_config") or {}
    checks = {"vision_config.use_qk_norm": (v.get("use_qk_norm", False), False),
              "vision_config.norm_type": (v.get("norm_type", "layer_norm"), "layer_norm"),
              "vision_config.use_mask_token": (v.get("use_mask_token", False), False),
              "vision_config.use_absolute_position_embeddings": (v.get("use_absolute_position_embeddings", True), True),
              "vision_feature_select_strategy": (hf.get("vision_feature_select_strategy", "default"), "default")}
    for key, (have, want) in checks.items():
        if have != want:
            raise ValueError(f"{where}: {key}={have!r} is not supported (the functional InternViT has {want!r})")
    sizes = {}
    for key in ("image_size", "patch_size"):
        x = v.get(key, 448 if key == "image_size" else 14)
        x = list(x) if isinstance(x, (list, tuple)) else [x, x]
        if x[0] != x[1]:
            raise ValueError(f"{where}: vision_config.{key}={x} is not supported (square tiles and patches)")
        sizes[key] = int(x[0])
    ratio = float(hf.get("downsample_ratio", 0.5))
    if ratio <= 0 or abs(1 / ratio - round(1 / ratio)) > 1e-9:
        raise ValueError(f"{where}: downsample_ratio={ratio} is not supported (1 / an integer)")
    layer = hf.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise ValueError(f"{where}: vision_feature_layer={layer!r} is not supported (one layer's hidden states)")
    try:
        return InternVLConfig(hidden=v.get("hidden_size", 1024), layers=v.get("num_hidden_layers", 24),
                              heads=v.get("num_attention_heads", 16), mlp=v.get("intermediate_size", 4096),
                              patch_size=sizes["patch_size"], channels=v.get("num_channels", 3),
                              image_size=sizes["image_size"], norm_eps=v.get("layer_norm_eps", 1e-6),
                              act=v.get("hidden_act", "gelu"), attention_bias=v.get("attention_bias", False),
                              final_norm=not v.get("use_mean_pooling", True), feature_layer=layer,
                              merge=int(round(1 / ratio)), projector_hidden=text.get("hidden_size", 4096),
                              projector_act=hf.get("projector_hidden_act", "gelu"),
                              image_token_id=hf.get("image_token_id", 151667))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def config_to_hf(cfg: Config, write: Callable[[Config], dict]) -> dict:
    """The ``internvl`` ``config.json`` of ``cfg`` around its text decoder's (``write``'s: a Qwen
    one) and its tower's."""
    v = cfg.vision
    text = write(dataclasses.replace(cfg, text_of=None, vision=None))
    vision = {"model_type": "internvl_vision", "hidden_size": v.hidden, "num_hidden_layers": v.layers,
              "num_attention_heads": v.heads, "intermediate_size": v.mlp, "patch_size": [v.patch_size] * 2,
              "image_size": [v.image_size] * 2, "num_channels": v.channels, "layer_norm_eps": v.norm_eps,
              "hidden_act": v.act, "attention_bias": v.attention_bias, "use_mean_pooling": not v.final_norm,
              "use_qk_norm": False, "norm_type": "layer_norm"}
    return wrapped_config(WRAPPER, CLASS, text, vision, True, image_token_id=v.image_token_id,
                          downsample_ratio=1 / v.merge, projector_hidden_act=v.projector_act,
                          vision_feature_layer=v.feature_layer, vision_feature_select_strategy="default",
                          image_seq_length=(v.grid // v.merge) ** 2)
