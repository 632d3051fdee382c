"""Hugging Face names and config of a PaddleOCR-VL checkpoint (``PaddleOCRVLForConditionalGeneration``):
its ERNIE-4.5 text decoder (the ``ernie4_5`` switches with the rotate-half multimodal rotary,
``mrope_section`` contiguous) under ``model.`` in the files (transformers 5's modules:
``model.language_model.``), its NaViT SigLIP tower under ``visual.vision_model.`` and its projector
under ``mlp_AR.`` (transformers' ``model.projector.``). The tower is
models/qwen_vision.py's (``tower: paddleocr_vl``: one frame per patch, ``post_norm``, the projector's
LayerNorm of epsilon 1e-5, the position table resampled at half-pixel centres), so its tensors are
Qwen's table rows (models/qwen_vision_hf.py) renamed here (:data:`RENAMED`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from functional_pp.models.llama import Config
from functional_pp.models.multimodal_hf import wrapped_config
from functional_pp.models.qwen_vision import QwenVisionConfig

WRAPPER = "paddleocr_vl"
WRAPPERS = (WRAPPER,)
TEXT = "ernie4_5"
"""The multimodal ``model_type`` this module reads and the family its text decoder reads as."""
CLASS = "PaddleOCRVLForConditionalGeneration"

_V = "visual.vision_model."
_L = _V + r"encoder.layers.\1."
RENAMED = ((r"^visual\.patch_embed\.proj\.", _V + "embeddings.patch_embedding."),
           (r"^visual\.pos_embed\.", _V + "embeddings.position_embedding."),
           (r"^visual\.post_layernorm\.", _V + "post_layernorm."),
           (r"^visual\.blocks\.(\d+)\.norm(\d)\.", _L + r"layer_norm\2."),
           (r"^visual\.blocks\.(\d+)\.attn\.([qkv])\.", _L + r"self_attn.\2_proj."),
           (r"^visual\.blocks\.(\d+)\.attn\.proj\.", _L + "self_attn.out_proj."),
           (r"^visual\.blocks\.(\d+)\.mlp\.linear_fc(\d)\.", _L + r"mlp.fc\2."),
           (r"^visual\.merger\.norm\.", "mlp_AR.pre_norm."),
           (r"^visual\.merger\.linear_fc(\d)\.", r"mlp_AR.linear_\1."))
"""Qwen's names of the tower's tensors as PaddleOCR-VL's files hold them (the decoder's as they are)."""

KINDS = {"patch_embed": "squeeze_2"}
"""The patch convolution: an ``nn.Conv2d`` in the files (ours: Qwen's Conv3d of one frame)."""


_NOT_TEXT = ("model_type", "architectures", "auto_map", "vision_config", "text_config")


def text_config(hf: dict, read: Callable) -> Any:
    """The ``Config`` of a ``paddleocr_vl`` ``config.json``'s text decoder (``read``: the reader of an
    ``ernie4_5`` config): ERNIE 4.5's layers with the rotate-half multimodal rotary."""
    import dataclasses
    # (the hub's files: a flat config.json, the decoder's keys beside vision_config, as transformers reads them)
    text = dict(hf.get("text_config") or {k: x for k, x in hf.items() if k not in _NOT_TEXT})
    if "hidden_size" not in text:
        raise ValueError("HF paddleocr_vl config: neither text_config nor the decoder's keys (hidden_size, ...) "
                         "are in it (the text decoder's sizes are unknown)")
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.pop("mrope_section", [16, 24, 24])
    text.update(model_type=TEXT, rope_parameters=rope)
    text.pop("rope_scaling", None)
    return dataclasses.replace(read(text), text_of=WRAPPER, rotary_interleaved=False,
                               mrope_section=tuple(int(x) for x in section), mrope_interleaved=False)


def vision_from_hf(hf: dict) -> QwenVisionConfig:
    """The tower and projector of a ``paddleocr_vl`` ``config.json``, refusing by name what the
    functional tower does not reproduce."""
    v = dict(hf.get("vision_config") or {})
    where = "HF paddleocr_vl config"
    rope = v.get("rope_parameters") or {}
    checks = {"vision_config.rope_parameters.rope_type": (rope.get("rope_type", "axial"), "axial"),
              "vision_config.layer_norm_eps": (float(v.get("layer_norm_eps", 1e-6)), 1e-6),
              "vision_config.num_channels": (v.get("num_channels", 3), 3)}
    for key, (have, want) in checks.items():
        if have != want:
            raise ValueError(f"{where}: {key}={have!r} is not supported (the functional tower has {want!r})")
    patch = v.get("patch_size", 14)
    return QwenVisionConfig(hidden=v.get("hidden_size", 1152), layers=v.get("num_hidden_layers", 27),
                            heads=v.get("num_attention_heads", 16), mlp=v.get("intermediate_size", 4304),
                            patch_size=patch, temporal_patch=1, channels=3, merge=v.get("spatial_merge_size", 2),
                            positions=(v.get("image_size", 384) // patch) ** 2,
                            rope_theta=float(rope.get("rope_theta", 10000.0)),
                            hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
                            image_token_id=hf.get("image_token_id", 100295), tower=WRAPPER, post_norm=True,
                            merger_eps=1e-5, align_corners=False)


def config_to_hf(cfg: Config, write: Callable[[Config], dict]) -> dict:
    """The ``paddleocr_vl`` ``config.json`` of ``cfg`` around its text decoder's (``write``'s: an
    ``ernie4_5`` config, its multimodal rotary's ``mrope_section`` added here) and its tower's."""
    v, mrope_section = cfg.vision, cfg.mrope_section
    plain = dict(text_of=None, vision=None, rotary_interleaved=True, mrope_section=None, mrope_interleaved=False)
    text = write(dataclasses.replace(cfg, **plain))
    rope = dict(text.get("rope_parameters") or {"rope_type": "default", "rope_theta": text.get("rope_theta", 5e5)})
    rope["mrope_section"] = list(mrope_section or (16, 24, 24))
    text.update(model_type="paddleocr_vl_text", rope_parameters=rope)
    side = int(v.positions ** 0.5)
    vision = {"model_type": "paddleocr_vl_vision", "hidden_size": v.hidden, "num_hidden_layers": v.layers,
              "num_attention_heads": v.heads, "intermediate_size": v.mlp, "patch_size": v.patch_size,
              "image_size": side * v.patch_size, "num_channels": v.channels, "hidden_act": v.hidden_act,
              "layer_norm_eps": 1e-6, "spatial_merge_size": v.merge,
              "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    return wrapped_config(WRAPPER, CLASS, text, vision, True, image_token_id=v.image_token_id)
