"""Hugging Face names and config of an LFM2-VL checkpoint (``Lfm2VlForConditionalGeneration``;
models/lfm2_vl.py): the LFM2 text decoder under ``model.language_model.``, the SigLIP2 tower under
``model.vision_tower.`` (the hub's files: ``model.vision_tower.vision_model.``, read too) and the
projector under ``model.multi_modal_projector.``, and the
:class:`~functional_pp.models.lfm2_vl.Lfm2VlConfig` of its ``config.json``."""
from __future__ import annotations

import dataclasses
from typing import Callable

from functional_pp.models.lfm2_vl import Lfm2VlConfig
from functional_pp.models.llama import Config
from functional_pp.models.multimodal_hf import wrapped_config

_LAYER = "vision_tower.encoder.layers.{i}."
_OURS = "vision_tower.encoder.layers.{i}."
TABLE = (
    ("vision_tower.embeddings.patch_embedding.weight", "vision_tower.embeddings.patch_embedding", "flat_in"),
    ("vision_tower.embeddings.patch_embedding.bias", "vision_tower.embeddings.patch_embedding_bias", "copy"),
    ("vision_tower.embeddings.position_embedding.weight", "vision_tower.embeddings.position_embedding", "copy"),
    ("vision_tower.post_layernorm.weight", "vision_tower.post_layernorm", "copy"),
    ("vision_tower.post_layernorm.bias", "vision_tower.post_layernorm_bias", "copy"),
    *((_LAYER + f"layer_norm{j}.{x}", _OURS + f"layer_norm{j}{s}", "copy")
      for j in (1, 2) for x, s in (("weight", ""), ("bias", "_bias"))),
    *((_LAYER + f"self_attn.{x}_proj.weight", _OURS + f"self_attn.{x}_proj", "heads_out") for x in "qkv"),
    *((_LAYER + f"self_attn.{x}_proj.bias", _OURS + f"self_attn.{x}_bias", "bias_heads") for x in "qkv"),
    (_LAYER + "self_attn.out_proj.weight", _OURS + "self_attn.out_proj", "heads_in"),
    (_LAYER + "self_attn.out_proj.bias", _OURS + "self_attn.out_bias", "copy"),
    *((_LAYER + f"mlp.fc{j}.weight", _OURS + f"mlp.fc{j}", "linear") for j in (1, 2)),
    *((_LAYER + f"mlp.fc{j}.bias", _OURS + f"mlp.fc{j}_bias", "copy") for j in (1, 2)),
    ("multi_modal_projector.layer_norm.weight", "multi_modal_projector.layer_norm", "copy"),
    ("multi_modal_projector.layer_norm.bias", "multi_modal_projector.layer_norm_bias", "copy"),
)
"""``(HF name pattern, our path pattern, transform kind)`` rows of the decoder table (llama_hf.LLAMA_TABLE;
the projector's linears are models/pixtral_hf.py's rows); the names before :data:`RENAMED`."""

WRAPPER = "lfm2_vl"
WRAPPERS = (WRAPPER,)
TEXT = "lfm2"
"""The multimodal ``model_type`` this module reads and its text decoder's family."""

RENAMED = ((r"^model\.", "model.language_model."), (r"^(vision_tower|multi_modal_projector)\.", r"model.\1."))
"""The files' (and transformers 5's modules') names: the decoder under ``model.language_model.``, the
tower and projector under ``model.``; ``lm_head`` as it is."""

ALSO_READ = ((r"^model\.vision_tower\.", "model.vision_tower.vision_model."),)
"""The tower's tensors as the hub's LFM2-VL files hold them (transformers 4's ``Siglip2VisionModel``)."""

CLASS = "Lfm2VlForConditionalGeneration"


def vision_from_hf(hf: dict) -> Lfm2VlConfig:
    """The tower and projector of an ``lfm2_vl`` ``config.json``, refusing by name what the functional
    tower does not reproduce."""
    v = dict(hf.get("vision_config") or {})
    where = "HF lfm2_vl config"
    if v.get("model_type", "siglip2_vision_model") != "siglip2_vision_model":
        raise ValueError(f"{where}: vision_config.model_type={v.get('model_type')!r} is not supported (LFM2-VL's "
                         f"tower is siglip2_vision_model)")
    if isinstance(v.get("patch_size"), (list, tuple)):
        raise ValueError(f"{where}: vision_config.patch_size={v['patch_size']!r} is not supported (one size)")
    try:
        return Lfm2VlConfig(hidden=v.get("hidden_size", 768), layers=v.get("num_hidden_layers", 12),
                            heads=v.get("num_attention_heads", 12), mlp=v.get("intermediate_size", 3072),
                            patch_size=v.get("patch_size", 16), channels=v.get("num_channels", 3),
                            positions=v.get("num_patches", 256), norm_eps=v.get("layer_norm_eps", 1e-6),
                            act=v.get("hidden_act", "gelu_pytorch_tanh"), merge=hf.get("downsample_factor", 2),
                            projector_hidden=hf.get("projector_hidden_size", 2560),
                            projector_bias=hf.get("projector_bias", True),
                            projector_norm=hf.get("projector_use_layernorm", True),
                            projector_act=hf.get("projector_hidden_act", "gelu"),
                            image_token_id=hf.get("image_token_id", 396))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def config_to_hf(cfg: Config, write: Callable[[Config], dict]) -> dict:
    """The ``lfm2_vl`` ``config.json`` of ``cfg`` around its text decoder's (``write``'s: an
    ``lfm2`` config) and its tower's."""
    v = cfg.vision
    text = write(dataclasses.replace(cfg, text_of=None, vision=None))
    vision = {"model_type": "siglip2_vision_model", "hidden_size": v.hidden, "num_hidden_layers": v.layers,
              "num_attention_heads": v.heads, "intermediate_size": v.mlp, "patch_size": v.patch_size,
              "num_channels": v.channels, "num_patches": v.positions, "layer_norm_eps": v.norm_eps,
              "hidden_act": v.act, "vision_use_head": False}
    return wrapped_config(WRAPPER, CLASS, text, vision, True, image_token_id=v.image_token_id,
                          downsample_factor=v.merge, projector_hidden_size=v.projector_hidden,
                          projector_bias=v.projector_bias, projector_use_layernorm=v.projector_norm,
                          projector_hidden_act=v.projector_act)
