"""Hugging Face names and config of a GLM-4V checkpoint (GLM-4.1V, GLM-4.6V-Flash:
``Glm4vForConditionalGeneration``, ``model_type`` ``glm4v``; transformers' ``glm46v`` the same
model): a GLM-4-0414 decoder (``glm4``'s layer: q/k/v biases, interleaved partial rotary, sandwich
norms, gate / up fused) whose rotary is the multimodal one (``mrope_section``, contiguous) under
``model.language_model.``, and the vision tower of models/glm4v_vision.py under ``model.visual.``
(Qwen's table rows, models/qwen_vision_hf.py, where the tensors are the same, :data:`TABLE` for
GLM's own; :data:`RENAMED` their names in the files)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from functional_pp.models import qwen_vision_hf
from functional_pp.models.glm4v_vision import Glm4vVisionConfig
from functional_pp.models.llama import Config
from functional_pp.models.multimodal_hf import wrapped_config

WRAPPERS = ("glm4v", "glm46v")
"""The multimodal ``model_type`` values this module reads (``Config.text_of``)."""
TEXT = "glm4"
"""The family the text decoder reads as."""
CLASSES = {"glm4v": "Glm4vForConditionalGeneration", "glm46v": "Glm46VForConditionalGeneration"}
"""The multimodal class export writes for each wrapper."""

_BLOCK = "visual.blocks.{i}."
_OURS = "vision_tower.blocks.{i}."
TABLE = (
    ("visual.post_conv_layernorm.weight", "vision_tower.post_conv_norm", "copy"),
    # (its post_layernorm: the Qwen tower's row, qwen_vision_hf.TABLE)
    ("visual.downsample.weight", "vision_tower.downsample", "copy"),
    ("visual.downsample.bias", "vision_tower.downsample_bias", "copy"),
    *((_BLOCK + f"mlp.{x}_proj.weight", _OURS + f"mlp.{x}_proj", "linear") for x in ("gate", "up", "down")),
    ("visual.merger.proj.weight", "multi_modal_projector.proj", "linear"),
    *((f"visual.merger.{x}_proj.weight", f"multi_modal_projector.{x}_proj", "linear") for x in ("gate", "up", "down")),
)
"""GLM's own rows of the decoder table (llama_hf.LLAMA_TABLE); the patch convolution, the position
table, the blocks' norms and attention and the merger's LayerNorm are Qwen's rows."""

RENAMED = ((r"^model\.", "model.language_model."),
           (r"^visual\.pos_embed\.", "visual.embeddings.position_embedding."),
           (r"^visual\.merger\.norm\.", "visual.merger.post_projection_norm."),
           (r"^visual\.", "model.visual."))
"""The files' names (after the text family's renames): the decoder under ``model.language_model.``,
the tower under ``model.visual.``, GLM's names of Qwen's tensors."""

FUSED = ((("model.language_model.layers.{i}.mlp.gate_up_proj.weight",
           ("model.language_model.layers.{i}.mlp.gate_proj.weight",
            "model.language_model.layers.{i}.mlp.up_proj.weight")),) + qwen_vision_hf.FUSED)
"""Gate and up along the rows of each layer's ``gate_up_proj``; q, k and v along the tower's ``attn.qkv``."""

IGNORED = (r"model\.visual\..*",)
"""What the text decoder alone does not read."""


def text_config(hf: dict, read: Callable) -> Any:
    """The ``Config`` of a ``glm4v`` / ``glm46v`` ``config.json``'s text decoder (``read``: the
    reader of a ``glm4`` config): head_dim hidden / heads, q/k/v biases, the rotary's share
    ``partial_rotary_factor`` (default 1), its sections ``mrope_section`` (contiguous)."""
    mt = hf.get("model_type")
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError(f"HF {mt} config: text_config is missing (the text decoder's sizes are unknown)")
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    rope.setdefault("rope_theta", text.pop("rope_theta", 10000.0))
    rope["partial_rotary_factor"] = float(rope.get("partial_rotary_factor") or text.get("partial_rotary_factor") or 1.0)
    hidden, heads = text.get("hidden_size", 4096), text.get("num_attention_heads", 32)
    text.update(model_type=TEXT, rope_parameters=rope, head_dim=hidden // heads, attention_bias=True,
                partial_rotary_factor=rope["partial_rotary_factor"])
    text.setdefault("rms_norm_eps", 1e-5)
    text.setdefault("max_position_embeddings", 32768)
    text.setdefault("pad_token_id", None)
    text.pop("rope_scaling", None)
    cfg = dataclasses.replace(read(text), text_of=mt)
    if section is None:
        return cfg
    return dataclasses.replace(cfg, mrope_section=tuple(int(x) for x in section), mrope_interleaved=False)


def vision_from_hf(hf: dict) -> Glm4vVisionConfig:
    """The vision tower of a ``glm4v`` / ``glm46v`` ``config.json``, refusing by name what the
    functional tower does not reproduce."""
    mt = hf.get("model_type")
    v = dict(hf.get("vision_config") or {})
    where = f"HF {mt} config"
    if mt not in WRAPPERS:
        raise ValueError(f"{where}: GLM-4V's vision tower is read for model_type {', '.join(WRAPPERS)}")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"{where}: vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         f"(the functional tower's rotary is 'axial')")
    for key in ("patch_size", "temporal_patch_size", "image_size"):
        if isinstance(v.get(key), (list, tuple)):
            raise ValueError(f"{where}: vision_config.{key}={v[key]!r} is not supported (one size)")
    patch, image = v.get("patch_size", 14), v.get("image_size", 336)
    return Glm4vVisionConfig(hidden=v.get("hidden_size", 1536), layers=v.get("depth", 24),
                             heads=v.get("num_heads", 12), out_hidden=v.get("out_hidden_size", 4096),
                             merger_mlp=v.get("intermediate_size", 13696), patch_size=patch,
                             temporal_patch=v.get("temporal_patch_size", 2), channels=v.get("in_channels", 3),
                             merge=v.get("spatial_merge_size", 2), positions=(image // patch) ** 2,
                             rope_theta=float(rope.get("rope_theta", 10000.0)), hidden_act=v.get("hidden_act", "silu"),
                             norm_eps=float(v.get("rms_norm_eps", 1e-5)),
                             attention_bias=bool(v.get("attention_bias", False)),
                             image_token_id=hf.get("image_token_id", 151343))


def config_to_hf(cfg: Config, write: Callable[[Config], dict]) -> dict:
    """The multimodal ``config.json`` of ``cfg`` around its text decoder's (``write``'s: a ``glm4``
    config, its multimodal rotary's ``mrope_section`` added here) and its tower's."""
    mt, v, mrope_section = cfg.text_of or cfg.model_type, cfg.vision, cfg.mrope_section
    text = write(dataclasses.replace(cfg, text_of=None, vision=None, mrope_section=None))
    if text["head_dim"] != text["hidden_size"] // text["num_attention_heads"]:
        raise ValueError(f"export as {CLASSES[mt]}: head_dim={text['head_dim']} is not hidden_size / heads = "
                         f"{text['hidden_size'] // text['num_attention_heads']} (its text config has no head_dim)")
    if not text.get("attention_bias", True):
        raise ValueError(f"export as {CLASSES[mt]}: its attention has q/k/v biases, the model has none")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
            "attention_dropout", "pad_token_id", "dtype")
    out_text = {k: text[k] for k in keep if k in text}
    rope = dict(text.get("rope_parameters") or {})
    rope.update(rope_type=rope.get("rope_type", "default"), partial_rotary_factor=text["partial_rotary_factor"])
    if mrope_section is not None:
        rope["mrope_section"] = list(mrope_section)
    out_text.update(model_type="glm4v_text", rope_parameters=rope)
    image = int(v.side * v.patch_size)
    vision = {"model_type": "glm4v_vision", "depth": v.layers, "hidden_size": v.hidden, "num_heads": v.heads,
              "out_hidden_size": v.out_hidden, "intermediate_size": v.merger_mlp, "hidden_act": v.hidden_act,
              "patch_size": v.patch_size, "image_size": image, "temporal_patch_size": v.temporal_patch,
              "in_channels": v.channels, "spatial_merge_size": v.merge, "rms_norm_eps": v.norm_eps,
              "attention_bias": v.attention_bias, "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    return wrapped_config(mt, CLASSES[mt], text, vision, False, out_text, image_token_id=v.image_token_id)
