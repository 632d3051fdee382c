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

WRAPPERS = ("mistral3", "llava")
"""The multimodal ``model_type`` values whose images this module reads (LLaVA: with a Pixtral tower, Pixtral 12B)."""


def vision_from_hf(hf: dict) -> VisionConfig:
    """The vision encoder and projector of a multimodal ``config.json`` (Mistral 3's), refusing by
    name what the functional encoder does not reproduce."""
    mt = hf.get("model_type")
    v = dict(hf.get("vision_config") or {})
    where = f"HF {mt} config"
    tower = v.get("model_type", "pixtral" if mt == "mistral3" else "clip_vision_model")   # (the classes' defaults)
    if mt not in WRAPPERS or tower != "pixtral":
        raise ValueError(f"images of model_type {mt!r} (processor_type; vision tower {tower!r}) are not supported "
                         f"yet: images are read for model_type {', '.join(WRAPPERS)} with a Pixtral tower (Mistral "
                         f"3's projector, LLaVA's); train {mt!r} on text (drop processor_type and the image columns)")
    checks = {"vision_config.model_type": (tower, "pixtral"),
              "vision_feature_layer": (hf.get("vision_feature_layer", -1), -1),
              "vision_config.hidden_act": (v.get("hidden_act", "gelu"), "gelu"),
              "projector_hidden_act": (hf.get("projector_hidden_act", "gelu"), "gelu"),
              "vision_config.rope_parameters.rope_type": ((v.get("rope_parameters") or {}).get("rope_type", "axial"),
                                                          "axial")}
    for key, (have, want) in checks.items():
        if have != want:
            raise ValueError(f"{where}: {key}={have!r} is not supported (the functional encoder has {want!r})")
    if mt == "llava" and hf.get("vision_feature_select_strategy", "default") != "full":
        raise ValueError(f"{where}: vision_feature_select_strategy="
                         f"{hf.get('vision_feature_select_strategy', 'default')!r} with a Pixtral tower is not "
                         f"supported ('default' drops the first patch as if it were CLIP's class token; Pixtral 12B's "
                         f"is 'full')")
    theta = (v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0))
    text = hf.get("text_config") or {}
    return VisionConfig(hidden=v.get("hidden_size", 1024), layers=v.get("num_hidden_layers", 24),
                        heads=v.get("num_attention_heads", 16), mlp=v.get("intermediate_size", 4096),
                        patch_size=v.get("patch_size", 16), channels=v.get("num_channels", 3), rope_theta=theta,
                        merge=hf.get("spatial_merge_size", 2) if mt == "mistral3" else 1,
                        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 10)),
                        projector_bias=hf.get("multimodal_projector_bias", mt == "llava"),
                        projector="llava" if mt == "llava" else "mistral3",
                        projector_eps=text.get("rms_norm_eps", 1e-5), image_size=v.get("image_size", 1024))


CLASSES = {"mistral3": "Mistral3ForConditionalGeneration", "llava": "LlavaForConditionalGeneration"}


def config_to_hf(mt: str, text: dict, v: VisionConfig) -> dict:
    """The multimodal ``config.json`` of ``mt`` around the text decoder's (``text``) and ``v``."""
    vision = {"model_type": "pixtral", "hidden_size": v.hidden, "intermediate_size": v.mlp,
              "num_hidden_layers": v.layers, "num_attention_heads": v.heads, "head_dim": v.head_dim,
              "patch_size": v.patch_size, "num_channels": v.channels, "image_size": v.image_size,
              "hidden_act": "gelu", "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    text = {k: x for k, x in text.items() if k != "architectures"}
    out = {"model_type": mt, "architectures": [CLASSES[mt]], "text_config": text, "vision_config": vision,
           "image_token_index": v.image_token_id, "projector_hidden_act": "gelu",
           "multimodal_projector_bias": v.projector_bias, "vision_feature_layer": -1,
           "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    if "dtype" in text:
        out["dtype"] = text["dtype"]
    if mt == "mistral3":
        out["spatial_merge_size"] = v.merge
    else:
        out["vision_feature_select_strategy"] = "full"
    return out
