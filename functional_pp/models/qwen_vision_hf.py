"""Hugging Face names and config of a Qwen3.5 checkpoint's vision tower (models/qwen_vision.py):
``model.visual.`` tensors (``Qwen3_5VisionModel``; its ``merger`` the projector, its fused
``attn.qkv`` split into q, k and v on import, :data:`FUSED`) and the
:class:`~functional_pp.models.qwen_vision.QwenVisionConfig` of its ``config.json``."""
from __future__ import annotations

from functional_pp.models.qwen_vision import QwenVisionConfig

_BLOCK = "visual.blocks.{i}."
_OURS = "vision_tower.blocks.{i}."
TABLE = (
    ("visual.patch_embed.proj.weight", "vision_tower.patch_embed", "copy"),
    ("visual.patch_embed.proj.bias", "vision_tower.patch_bias", "copy"),
    ("visual.pos_embed.weight", "vision_tower.pos_embed", "copy"),
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

WRAPPERS = ("qwen3_5",)
"""The multimodal ``model_type`` values whose images this module reads."""

RENAMED = ((r"^visual\.", "model.visual."),)
"""The tower's tensors live under ``model.visual.`` in the files."""

FUSED = tuple((f"model.visual.blocks.{{i}}.attn.qkv.{x}",
               tuple(f"model.visual.blocks.{{i}}.attn.{p}.{x}" for p in "qkv")) for x in ("weight", "bias"))
"""q, k and v along the rows of each block's ``attn.qkv`` weight and bias."""


def vision_from_hf(hf: dict) -> QwenVisionConfig:
    """The vision tower of a multimodal ``qwen3_5`` ``config.json``, refusing by name what the
    functional tower does not reproduce."""
    mt = hf.get("model_type")
    v = dict(hf.get("vision_config") or {})
    where = f"HF {mt} config"
    if mt not in WRAPPERS:
        raise ValueError(f"{where}: Qwen's vision tower is read for model_type {', '.join(WRAPPERS)}")
    text = hf.get("text_config") or {}
    rope = v.get("rope_parameters") or {}
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
