"""Hugging Face names and config of a Gemma 4 unified checkpoint's image side
(models/gemma4_unified.py): ``Gemma4UnifiedVisionEmbedder``'s tensors as its files hold them
(transformers renames them on load: ``conversion_mapping.py``): ``model.vision_embedder.`` (three
LayerNorms with biases, a linear with a bias, the position table) and the multimodal embedder's
projection ``model.embed_vision.embedding_projection`` and the :class:`~functional_pp.models.gemma4_unified.UnifiedVisionConfig`
of its ``config.json``. The audio embedder stays unread (models/gemma4_hf.py's ``IGNORED``); audio
inputs are refused by the data path."""
from __future__ import annotations

import dataclasses
from typing import Callable

from functional_pp.models.gemma4_unified import UnifiedVisionConfig
from functional_pp.models.llama import Config
from functional_pp.models.multimodal_hf import wrapped_config

_OURS = "multi_modal_projector."
TABLE = (
    *((f"vision_embedder.{n}.weight", _OURS + n, "copy") for n in ("patch_ln1", "patch_ln2", "pos_norm")),
    *((f"vision_embedder.{n}.bias", _OURS + f"{n}_bias", "copy") for n in ("patch_ln1", "patch_ln2", "pos_norm",
                                                                            "patch_dense")),
    ("vision_embedder.patch_dense.weight", _OURS + "patch_dense", "linear"),
    ("vision_embedder.pos_embedding", _OURS + "pos_embedding", "copy"),
)
"""``(HF name pattern, our path pattern, transform kind)`` rows of the decoder table (llama_hf.LLAMA_TABLE);
the projection's row is Gemma 4's (``embed_vision.embedding_projection``)."""

RENAMED = ((r"^vision_embedder\.", "model.vision_embedder."),)
"""The embedder's tensors live under ``model.`` (after the text decoder's ``model.language_model.``)."""

MODULE_NAMES = ((r"^model\.embed_vision\.embedding_projection\.",
                 "model.embed_vision.multimodal_embedder.embedding_projection."),
                (r"^model\.vision_embedder\.", "model.embed_vision."))
"""The files' names -> the modules' names in transformers' model (its load-time renames)."""

WRAPPERS = ("gemma4_unified",)
"""The multimodal ``model_type`` whose images this module reads."""

CLASS = "Gemma4UnifiedForConditionalGeneration"

_TEXT_ONLY = ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block", "num_experts",
              "top_k_experts", "moe_intermediate_size")
"""``Gemma4TextConfig`` keys ``Gemma4UnifiedTextConfig`` does not have."""


def vision_from_hf(hf: dict) -> UnifiedVisionConfig:
    """The image embedder of a ``gemma4_unified`` ``config.json``, refusing what it does not reproduce."""
    where = f"HF {hf.get('model_type')} config"
    v = dict(hf.get("vision_config") or {})
    if not v:
        raise ValueError(f"{where}: no vision_config (a checkpoint without an image embedder): train it on text "
                         f"(drop processor_type and the image columns)")
    embed = int(v.get("mm_embed_dim", 3840))
    out = int(v.get("output_proj_dims", embed))
    if out != embed:
        raise ValueError(f"{where}: vision_config.output_proj_dims={out} differs from mm_embed_dim={embed} "
                         f"(transformers' embedder cannot run it either)")
    return UnifiedVisionConfig(patch_size=int(v.get("patch_size", 16)), pool=int(v.get("pooling_kernel_size", 3)),
                               embed=embed, positions=int(v.get("mm_posemb_size", 1120)),
                               norm_eps=float(v.get("rms_norm_eps", 1e-6)),
                               image_token_id=hf.get("image_token_id", 258_880),
                               boi_token_id=hf.get("boi_token_id", 255_999),
                               eoi_token_id=hf.get("eoi_token_id", 258_882))


def config_to_hf(cfg: Config, write: Callable[[Config], dict]) -> dict:
    """The ``gemma4_unified`` ``config.json`` of ``cfg`` around its text decoder's (``write``'s: a
    ``gemma4_text`` one) and its embedder's (no audio)."""
    v, bidirectional = cfg.vision, cfg.image_groups_attend
    text = write(dataclasses.replace(cfg, vision=None, model_type="gemma4_text", image_groups_attend=False))
    text = {k: x for k, x in text.items() if k not in ("architectures",) + _TEXT_ONLY}
    text.update(model_type="gemma4_unified_text", use_bidirectional_attention="vision" if bidirectional else None)
    vision = {"model_type": "gemma4_unified_vision", "patch_size": v.patch_size, "pooling_kernel_size": v.pool,
              "mm_embed_dim": v.embed, "mm_posemb_size": v.positions, "rms_norm_eps": v.norm_eps,
              "output_proj_dims": v.embed}
    return wrapped_config("gemma4_unified", CLASS, text, vision, True, audio_config=None,
                          image_token_id=v.image_token_id, boi_token_id=v.boi_token_id, eoi_token_id=v.eoi_token_id)
