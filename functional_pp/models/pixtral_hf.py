"""Hugging Face names and config of a Mistral 3 checkpoint's vision side (models/pixtral.py):
``vision_tower.`` (``PixtralVisionModel``) and ``multi_modal_projector.`` tensors, and the
:class:`~functional_pp.models.pixtral.VisionConfig` of its ``config.json``."""
from __future__ import annotations

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
    *((f"multi_modal_projector.linear_{j}.weight", f"multi_modal_projector.linear_{j}", "linear") for j in (1, 2)),
    *((f"multi_modal_projector.linear_{j}.bias", f"multi_modal_projector.linear_{j}_bias", "copy") for j in (1, 2)),
)
"""``(HF name pattern, our path pattern, transform kind)`` rows of the decoder table (llama_hf.LLAMA_TABLE)."""

WRAPPERS = ("mistral3",)
"""The multimodal ``model_type`` values whose images this module reads."""


def vision_from_hf(hf: dict) -> VisionConfig:
    """The vision encoder and projector of a multimodal ``config.json`` (Mistral 3's), refusing by
    name what the functional encoder does not reproduce."""
    mt = hf.get("model_type")
    v = dict(hf.get("vision_config") or {})
    where = f"HF {mt} config"
    if mt not in WRAPPERS:
        raise ValueError(f"images of model_type {mt!r} (processor_type; vision tower "
                         f"{v.get('model_type', 'unknown')!r}) are not supported yet: images are read for model_type "
                         f"{', '.join(WRAPPERS)} (Pixtral's encoder and Mistral 3's projector); train {mt!r} on text "
                         f"(drop processor_type and the image columns)")
    tower = v.get("model_type", "pixtral")
    checks = {"vision_config.model_type": (tower, "pixtral"),
              "vision_feature_layer": (hf.get("vision_feature_layer", -1), -1),
              "vision_config.hidden_act": (v.get("hidden_act", "gelu"), "gelu"),
              "projector_hidden_act": (hf.get("projector_hidden_act", "gelu"), "gelu"),
              "vision_config.rope_parameters.rope_type": ((v.get("rope_parameters") or {}).get("rope_type", "axial"),
                                                          "axial")}
    for key, (have, want) in checks.items():
        if have != want:
            raise ValueError(f"{where}: {key}={have!r} is not supported (the functional encoder has {want!r})")
    theta = (v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0))
    text = hf.get("text_config") or {}
    return VisionConfig(hidden=v.get("hidden_size", 1024), layers=v.get("num_hidden_layers", 24),
                        heads=v.get("num_attention_heads", 16), mlp=v.get("intermediate_size", 4096),
                        patch_size=v.get("patch_size", 16), channels=v.get("num_channels", 3), rope_theta=theta,
                        merge=hf.get("spatial_merge_size", 2),
                        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 10)),
                        projector_bias=hf.get("multimodal_projector_bias", False),
                        projector_eps=text.get("rms_norm_eps", 1e-5))
