"""Hugging Face names and config of a vision-language checkpoint's vision side (models/pixtral.py):
``vision_tower.`` (``PixtralVisionModel``, or ``CLIPVisionModel``: models/clip.py) and ``multi_modal_projector.`` tensors, and the
:class:`~functional_pp.models.pixtral.VisionConfig` of its ``config.json``."""
from __future__ import annotations

import dataclasses
from typing import Callable

from functional_pp.models.llama import Config
from functional_pp.models.multimodal_hf import wrapped_config
from functional_pp.models.pixtral import VisionConfig

_LAYER = "vision_tower.transformer.layers.{i}."
TABLE = (
    ("vision_tower.patch_conv.weight", "vision_tower.patch_conv", "copy"),
    ("vision_tower.ln_pre.weight", "vision_tower.ln_pre", "copy"),
    (_LAYER + "attention_norm.weight", "vision_tower.layers.{i}.attention_norm", "copy"),
    (_LAYER + "ffn_norm.weight", "vision_tower.layers.{i}.ffn_norm", "copy"),
    *((_LAYER + f"attention.{x}_proj.weight", f"vision_tower.layers.{{i}}.attention.{x}_proj", "heads_out")
      for x in "qkv"),
    (_LAYER + "attention.o_proj.weight", "vision_tower.layers.{i}.attention.o_proj", "heads_in"),
    *((_LAYER + f"feed_forward.{x}_proj.weight", f"vision_tower.layers.{{i}}.feed_forward.{x}_proj", "linear")
      for x in ("gate", "up", "down")),
    ("multi_modal_projector.norm.weight", "multi_modal_projector.norm", "copy"),
    ("multi_modal_projector.patch_merger.merging_layer.weight", "multi_modal_projector.merging_layer", "linear"),
    # CLIP's tower (models/clip.py: LLaVA-1.5)
    *((f"vision_tower.vision_model.{hf}", f"vision_tower.{ours}", kind) for hf, ours, kind in (
        ("embeddings.patch_embedding.weight", "patch_embedding", "copy"),
        ("embeddings.class_embedding", "class_embedding", "copy"),
        ("embeddings.position_embedding.weight", "position_embedding", "copy"),
        ("pre_layrnorm.weight", "pre_layrnorm", "copy"), ("pre_layrnorm.bias", "pre_layrnorm_bias", "copy"),
        *((f"encoder.layers.{{i}}.layer_norm{j}.{x}", f"layers.{{i}}.layer_norm{j}{s}", "copy")
          for j in (1, 2) for x, s in (("weight", ""), ("bias", "_bias"))),
        *((f"encoder.layers.{{i}}.self_attn.{x}_proj.weight", f"layers.{{i}}.self_attn.{x}_proj", "heads_out")
          for x in "qkv"),
        *((f"encoder.layers.{{i}}.self_attn.{x}_proj.bias", f"layers.{{i}}.self_attn.{x}_bias", "bias_heads")
          for x in "qkv"),
        ("encoder.layers.{i}.self_attn.out_proj.weight", "layers.{i}.self_attn.out_proj", "heads_in"),
        ("encoder.layers.{i}.self_attn.out_proj.bias", "layers.{i}.self_attn.out_bias", "copy"),
        *((f"encoder.layers.{{i}}.mlp.fc{j}.weight", f"layers.{{i}}.mlp.fc{j}", "linear") for j in (1, 2)),
        *((f"encoder.layers.{{i}}.mlp.fc{j}.bias", f"layers.{{i}}.mlp.fc{j}_bias", "copy") for j in (1, 2)))),
    *((f"multi_modal_projector.linear_{j}.weight", f"multi_modal_projector.linear_{j}", "linear") for j in (1, 2)),
    *((f"multi_modal_projector.linear_{j}.bias", f"multi_modal_projector.linear_{j}_bias", "copy") for j in (1, 2)),
)
"""``(HF name pattern, our path pattern, transform kind)`` rows of the decoder table (llama_hf.LLAMA_TABLE)."""

ALSO_READ = ((r"^vision_tower\.vision_model\.", "vision_tower."),)
"""A CLIP tower's tensors as transformers 5 saves them (the hub's LLaVA-1.5 files, and export, hold
``vision_tower.vision_model.``): llama_hf.ALSO_READ's rows for ``llava``."""

WRAPPERS = ("mistral3", "llava")
"""The multimodal ``model_type`` values whose images this module reads (LLaVA: with a Pixtral tower, Pixtral 12B,
or CLIP's, LLaVA-1.5)."""

TOWER_TYPES = {"pixtral": "pixtral", "clip_vision_model": "clip"}
"""``vision_config.model_type`` -> ``VisionConfig.tower`` (models/pixtral.py's VISION_TOWERS)."""


def vision_from_hf(hf: dict) -> VisionConfig:
    """The vision encoder and projector of a multimodal ``config.json`` (Mistral 3's, LLaVA's),
    refusing by name what the functional encoder does not reproduce."""
    mt = hf.get("model_type")
    v = dict(hf.get("vision_config") or {})
    where = f"HF {mt} config"
    tower = v.get("model_type", {"mistral3": "pixtral", "llava": "clip_vision_model"}.get(mt))   # (classes' defaults)
    if mt not in WRAPPERS or tower not in TOWER_TYPES or (mt == "mistral3" and tower != "pixtral"):
        raise ValueError(f"images of model_type {mt!r} (processor_type; vision tower {tower!r}) are not supported "
                         f"yet: images are read for model_type mistral3 with a Pixtral tower, llava with a Pixtral "
                         f"or CLIP tower, qwen3_5, qwen2_vl, glm4v / glm46v, gemma4, gemma4_unified, llama4, lfm2_vl "
                         f"and internvl with their own; train {mt!r} on text (drop "
                         f"processor_type and the image columns)")
    clip = tower == "clip_vision_model"
    layer = hf.get("vision_feature_layer", -2 if mt == "llava" else -1)
    if not isinstance(layer, int) or (not clip and layer != -1):
        raise ValueError(f"{where}: vision_feature_layer={layer!r} is not supported (the functional encoder reads "
                         f"one layer's hidden states: {'an integer' if clip else '-1'})")
    act = v.get("hidden_act", "quick_gelu" if clip else "gelu")
    checks = {"vision_config.hidden_act": (act, act if clip and act in ("quick_gelu", "gelu") else "gelu"),
              "projector_hidden_act": (hf.get("projector_hidden_act", "gelu"), "gelu")}
    if not clip:
        checks["vision_config.rope_parameters.rope_type"] = ((v.get("rope_parameters") or {}).get("rope_type", "axial"),
                                                             "axial")
    for key, (have, want) in checks.items():
        if have != want:
            raise ValueError(f"{where}: {key}={have!r} is not supported (the functional encoder has {want!r})")
    strategy = hf.get("vision_feature_select_strategy", "default") if mt == "llava" else "full"
    if not clip and strategy != "full":
        raise ValueError(f"{where}: vision_feature_select_strategy={strategy!r} with a Pixtral tower is not "
                         f"supported ('default' drops the first patch as if it were CLIP's class token; Pixtral 12B's "
                         f"is 'full')")
    theta = (v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0))
    text = hf.get("text_config") or {}
    defaults = dict(hidden=768, layers=12, heads=12, mlp=3072, patch=32, image=224) if clip else \
        dict(hidden=1024, layers=24, heads=16, mlp=4096, patch=16, image=1024)
    return VisionConfig(hidden=v.get("hidden_size", defaults["hidden"]),
                        layers=v.get("num_hidden_layers", defaults["layers"]),
                        heads=v.get("num_attention_heads", defaults["heads"]),
                        mlp=v.get("intermediate_size", defaults["mlp"]),
                        patch_size=v.get("patch_size", defaults["patch"]), channels=v.get("num_channels", 3),
                        rope_theta=theta, merge=hf.get("spatial_merge_size", 2) if mt == "mistral3" else 1,
                        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 32000 if clip else 10)),
                        projector_bias=hf.get("multimodal_projector_bias", mt == "llava"),
                        projector="llava" if mt == "llava" else "mistral3",
                        projector_eps=text.get("rms_norm_eps", 1e-5),
                        image_size=v.get("image_size", defaults["image"]), tower=TOWER_TYPES[tower],
                        feature_layer=layer, select_strategy=strategy, norm_eps=v.get("layer_norm_eps", 1e-5),
                        act=act)


CLASSES = {"mistral3": "Mistral3ForConditionalGeneration", "llava": "LlavaForConditionalGeneration"}


def config_to_hf(cfg: Config, write: Callable[[Config], dict]) -> dict:
    """The multimodal ``config.json`` of ``cfg`` (its ``text_of``) around its text decoder's (``write``'s)
    and its tower's."""
    mt, v = cfg.text_of, cfg.vision
    text = write(dataclasses.replace(cfg, text_of=None, vision=None))
    vision = {"hidden_size": v.hidden, "intermediate_size": v.mlp, "num_hidden_layers": v.layers,
              "num_attention_heads": v.heads, "patch_size": v.patch_size, "num_channels": v.channels,
              "image_size": v.image_size}
    if v.tower == "clip":
        vision.update(model_type="clip_vision_model", hidden_act=v.act, layer_norm_eps=v.norm_eps)
    else:
        vision.update(model_type="pixtral", head_dim=v.head_dim, hidden_act="gelu",
                      rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    own = {"spatial_merge_size": v.merge} if mt == "mistral3" else {"vision_feature_select_strategy": v.select_strategy}
    return wrapped_config(mt, CLASSES[mt], text, vision, False, image_token_index=v.image_token_id,
                          projector_hidden_act="gelu", multimodal_projector_bias=v.projector_bias,
                          vision_feature_layer=v.feature_layer, **own)
