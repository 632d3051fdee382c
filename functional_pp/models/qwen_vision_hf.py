"""Hugging Face names and config of a Qwen3.5 checkpoint's vision tower (models/qwen_vision.py):
``model.visual.`` tensors (``Qwen3_5VisionModel``; its ``merger`` the projector, its fused
``attn.qkv`` split into q, k and v on import, :data:`FUSED`) and the
:class:`~functional_pp.models.qwen_vision.QwenVisionConfig` of its ``config.json``; Qwen2-VL's
(``Qwen2VLForConditionalGeneration``): ``visual.`` beside a Qwen2 decoder under ``model.`` (its files'
layout: the decoder reads as ``qwen2``, its rotary the multimodal one, :func:`qwen2_vl_text`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from functional_pp.models.llama import Config
from functional_pp.models.multimodal_hf import wrapped_config
from functional_pp.models.qwen_vision import QwenVisionConfig

_BLOCK = "visual.blocks.{i}."
_OURS = "vision_tower.blocks.{i}."
TABLE = (
    ("visual.patch_embed.proj.weight", "vision_tower.patch_embed", "copy"),
    ("visual.patch_embed.proj.bias", "vision_tower.patch_bias", "copy"),
    ("visual.pos_embed.weight", "vision_tower.pos_embed", "copy"),
    ("visual.post_layernorm.weight", "vision_tower.post_norm", "copy"),         # (PaddleOCR-VL's)
    ("visual.post_layernorm.bias", "vision_tower.post_norm_bias", "copy"),
    *((_BLOCK + f"{n}.{x}", _OURS + (n if x == "weight" else f"{n}_bias"), "copy")
      for n in ("norm1", "norm2") for x in ("weight", "bias")),
    *((_BLOCK + f"attn.{x}.weight", _OURS + f"attn.{x}_proj", "heads_out") for x in "qkv"),
    *((_BLOCK + f"attn.{x}.bias", _OURS + f"attn.{x}_bias", "bias_heads") for x in "qkv"),
    (_BLOCK + "attn.proj.weight", _OURS + "attn.o_proj", "heads_in"),
    (_BLOCK + "attn.proj.bias", _OURS + "attn.o_bias", "copy"),
    *((_BLOCK + f"mlp.linear_{x}.weight", _OURS + f"mlp.{x}", "linear") for x in ("fc1", "fc2")),
    *((_BLOCK + f"mlp.linear_{x}.bias", _OURS + f"mlp.{x}_bias", "copy") for x in ("fc1", "fc2")),
    ("visual.merger.norm.weight", "multi_modal_projector.ln", "copy"),
    ("visual.merger.norm.bias", "multi_modal_projector.ln_bias", "copy"),
    *((f"visual.merger.linear_{x}.weight", f"multi_modal_projector.{x}", "linear") for x in ("fc1", "fc2")),
    *((f"visual.merger.linear_{x}.bias", f"multi_modal_projector.{x}_bias", "copy") for x in ("fc1", "fc2")),
)
"""``(HF name pattern, our path pattern, transform kind)`` rows of the decoder table (llama_hf.LLAMA_TABLE);
the names before :data:`RENAMED` (``model.visual.``) and :data:`FUSED` (``attn.qkv``)."""

WRAPPERS = ("qwen3_5", "qwen2_vl")
"""The multimodal ``model_type`` values whose images this module reads."""

RENAMED = ((r"^visual\.", "model.visual."),)
"""The tower's tensors live under ``model.visual.`` in the files."""


def _fused(pre: str) -> tuple:
    block = f"{pre}visual.blocks.{{i}}.attn."
    return tuple((f"{block}qkv.{x}", tuple(f"{block}{p}.{x}" for p in "qkv")) for x in ("weight", "bias"))


FUSED = _fused("model.")
"""q, k and v along the rows of each block's ``attn.qkv`` weight and bias."""

QWEN2_VL_TEXT = "qwen2"
"""The family Qwen2-VL's text decoder reads as (its files: ``model.layers.``, ``lm_head``)."""
QWEN2_VL_RENAMED = ((r"^visual\.blocks\.(\d+)\.mlp\.linear_", r"visual.blocks.\1.mlp."),
                    (r"^visual\.merger\.norm\.", "visual.merger.ln_q."),
                    (r"^visual\.merger\.linear_fc1\.", "visual.merger.mlp.0."),
                    (r"^visual\.merger\.linear_fc2\.", "visual.merger.mlp.2."))
"""Qwen2-VL's names of the same tensors (its MLP ``fc1`` / ``fc2``, its merger ``ln_q`` and ``mlp``)."""
QWEN2_VL_FUSED = _fused("")
TEXT_LAYOUT = ("qwen2_vl",)
"""The wrappers (``Config.text_of``) whose files keep the text model's names (``model.layers.``, ``visual.``)."""
MODULE_NAMES = ((r"^model\.", "model.language_model."), (r"^visual\.", "model.visual."))
"""Their modules' names in transformers 5 (what peft's targets name): the decoder under ``model.language_model.``."""


def qwen2_vl_text(hf: dict, read: Callable) -> Any:
    """The ``Config`` of a ``qwen2_vl`` ``config.json``'s text decoder (``read``: the reader of a
    ``qwen2`` config), its rotary the multimodal one (``mrope_section``, contiguous)."""
    import dataclasses
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError("HF qwen2_vl config: text_config is missing (the text decoder's sizes are unknown)")
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)
    text.update(model_type=QWEN2_VL_TEXT, rope_parameters=rope)
    text.pop("rope_scaling", None)
    cfg = dataclasses.replace(read(text), text_of="qwen2_vl")
    if section is None:
        return cfg
    return dataclasses.replace(cfg, mrope_section=tuple(int(x) for x in section), mrope_interleaved=False)


def vision_from_hf(hf: dict) -> QwenVisionConfig:
    """The vision tower of a multimodal ``qwen3_5`` or ``qwen2_vl`` ``config.json``, refusing by name
    what the functional tower does not reproduce."""
    mt = hf.get("model_type")
    v = dict(hf.get("vision_config") or {})
    where = f"HF {mt} config"
    if mt not in WRAPPERS:
        raise ValueError(f"{where}: Qwen's vision tower is read for model_type {', '.join(WRAPPERS)}")
    text = hf.get("text_config") or {}
    rope = v.get("rope_parameters") or {}
    if mt == "qwen2_vl":
        if v.get("hidden_size", 3584) != text.get("hidden_size", 3584):
            raise ValueError(f"{where}: vision_config.hidden_size={v.get('hidden_size')} (the merger's output) is "
                             f"not the text decoder's hidden_size={text.get('hidden_size')}")
        embed = v.get("embed_dim", 1280)
        return QwenVisionConfig(hidden=embed, layers=v.get("depth", 32), heads=v.get("num_heads", 16),
                                mlp=int(embed * v.get("mlp_ratio", 4)), patch_size=v.get("patch_size", 14),
                                temporal_patch=v.get("temporal_patch_size", 2), channels=v.get("in_channels", 3),
                                merge=v.get("spatial_merge_size", 2), positions=0,
                                rope_theta=float(rope.get("rope_theta", 10000.0)),
                                hidden_act=v.get("hidden_act", "quick_gelu"),
                                image_token_id=hf.get("image_token_id", 151655), tower="qwen2_vl", patch_bias=False)
    checks = {"vision_config.rope_parameters.rope_type": (rope.get("rope_type", "axial"), "axial"),
              "vision_config.out_hidden_size": (v.get("out_hidden_size", 3584), text.get("hidden_size", 4096)),
              "vision_config.deepstack_visual_indexes": (list(v.get("deepstack_visual_indexes") or []), [])}
    for key, (have, want) in checks.items():
        if have != want:
            raise ValueError(f"{where}: {key}={have!r} is not supported (the functional tower has {want!r})")
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(v.get(key), (list, tuple)):
            raise ValueError(f"{where}: vision_config.{key}={v[key]!r} is not supported (one size)")
    return QwenVisionConfig(hidden=v.get("hidden_size", 1152), layers=v.get("depth", v.get("num_hidden_layers", 27)),
                            heads=v.get("num_heads", v.get("num_attention_heads", 16)),
                            mlp=v.get("intermediate_size", 4304), patch_size=v.get("patch_size", 16),
                            temporal_patch=v.get("temporal_patch_size", 2), channels=v.get("in_channels", 3),
                            merge=v.get("spatial_merge_size", 2), positions=v.get("num_position_embeddings", 2304),
                            rope_theta=float(rope.get("rope_theta", 10000.0)),
                            hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
                            image_token_id=hf.get("image_token_id", 248056))


CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration"}
"""The multimodal class export writes for each wrapper."""


def config_to_hf(cfg: Config, write: Callable[[Config], dict]) -> dict:
    """The multimodal ``config.json`` of ``cfg`` (``qwen3_5``, ``qwen2_vl``) around its text decoder's
    (``write``'s: its text class's config; Qwen2-VL's: a Qwen2's, its multimodal rotary's
    ``mrope_section`` added here) and its tower's."""
    mt, v, mrope_section = cfg.text_of or cfg.model_type, cfg.vision, cfg.mrope_section
    plain = {"mrope_section": None, "mrope_interleaved": False} if cfg.text_of else {}   # (Qwen2-VL: a Qwen2)
    text = write(dataclasses.replace(cfg, text_of=None, vision=None, **plain))
    if mt == "qwen2_vl":
        rope = dict(text.get("rope_parameters") or {"rope_type": "default", "rope_theta": text.pop("rope_theta", 1e4)})
        if mrope_section is not None:
            rope["mrope_section"] = list(mrope_section)
        text.update(model_type="qwen2_vl_text", rope_parameters=rope)
        if v.mlp % v.hidden:
            raise ValueError(f"export as {CLASSES[mt]}: the tower's MLP width {v.mlp} is not a multiple of its width "
                             f"{v.hidden} (Qwen2-VL's vision_config holds an integer mlp_ratio)")
        vision = {"model_type": "qwen2_vl_vision", "depth": v.layers, "embed_dim": v.hidden, "num_heads": v.heads,
                  "mlp_ratio": v.mlp // v.hidden, "hidden_size": text["hidden_size"], "hidden_act": v.hidden_act}
    else:
        vision = {"model_type": "qwen3_5_vision", "depth": v.layers, "hidden_size": v.hidden, "num_heads": v.heads,
                  "intermediate_size": v.mlp, "out_hidden_size": text["hidden_size"], "hidden_act": v.hidden_act,
                  "num_position_embeddings": v.positions, "deepstack_visual_indexes": []}
    vision.update(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch, in_channels=v.channels,
                  spatial_merge_size=v.merge, rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    return wrapped_config(mt, CLASSES[mt], text, vision, False, image_token_id=v.image_token_id)
