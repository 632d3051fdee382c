"""Images into a Qwen decoder: InternVL's InternViT tower (transformers' ``InternVLVisionModel``) and
its projector (``InternVLMultiModalProjector``) as pure functions over named arrays, the same entries
and mechanism as models/pixtral.py (one tower of ``Config.vision``).

The data path (data/images.py's ``image_batch``, ``class_token="dropped"``) gives each tile's
patches in merge order, its class token's slot after all of them (zero pixels, position (0, -1)),
with each patch's row and column. The tower is CLIP's (models/clip.py) with a bias on the patch
convolution (not given to the class token), no pre-norm, and its encoder layers' branches scaled per
channel (``lambda_1``, ``lambda_2``); its final LayerNorm only where ``use_mean_pooling`` is off.
The class slots' features are dropped (``vision_feature_select_strategy: default``) and each
``merge x merge`` block of patches (``1 / downsample_ratio``) is one image token, through the pixel
unshuffle projector of models/lfm2_vl.py (its pixel shuffle is the same order) to the decoder's width."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models import clip, lfm2_vl
from functional_pp.parallel.named import Named

TOWER = "internvit"
TOWERS = (TOWER,)


@dataclass(frozen=True)
class InternVLConfig:
    """InternVL's ``vision_config`` (an ``internvl_vision``) and projector (``downsample_ratio``:
    ``merge = 1 / downsample_ratio``; its hidden width the decoder's); ``image_token_id``."""

    hidden: int = 1024
    layers: int = 24
    heads: int = 16
    mlp: int = 4096
    patch_size: int = 14
    channels: int = 3
    image_size: int = 448
    norm_eps: float = 1e-6
    act: str = "gelu"
    attention_bias: bool = True
    final_norm: bool = False           # (use_mean_pooling off: a LayerNorm on the last hidden states)
    feature_layer: int = -1
    merge: int = 2
    projector_hidden: int = 4096       # (the decoder's width)
    projector_act: str = "gelu"
    image_token_id: int = 151667
    tower: str = TOWER
    projector_norm: bool = True
    projector_bias: bool = True

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size or (self.image_size // self.patch_size) % self.merge:
            raise ValueError(f"InternVL: vision_config.image_size={self.image_size} must be patch_size="
                             f"{self.patch_size} times a multiple of 1 / downsample_ratio = {self.merge}")
        if self.hidden % self.heads:
            raise ValueError(f"InternVL: vision_config.hidden_size={self.hidden} is not a multiple of "
                             f"num_attention_heads={self.heads}")
        if self.act not in clip.ACTS or self.projector_act not in ("gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"InternVL: vision_config.hidden_act={self.act!r} (one of {clip.ACTS}) or "
                             f"projector_hidden_act={self.projector_act!r} (gelu, gelu_pytorch_tanh) is not supported")
        if not -self.layers <= self.feature_layer < 0:
            raise ValueError(f"InternVL: vision_feature_layer={self.feature_layer} must index the hidden states of "
                             f"its {self.layers} layers from the last (-1 .. -{self.layers})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def grid(self) -> int:
        """Patches per tile side (the position table's grid)."""
        return self.image_size // self.patch_size

    @property
    def used_layers(self) -> int:
        """The layers run (up to ``vision_feature_layer``)."""
        return self.layers + 1 + self.feature_layer


def init(v: InternVLConfig, text_hidden: int, dtype: torch.dtype, std: float) -> dict:
    """The declarations of the tower (``vision_tower``) and the projector (``multi_modal_projector``)."""
    def w(shape, dims):
        return param(shape, dims, init="normal", scale=std, dtype=dtype)

    def vec(n, dims, how):
        return param(n if isinstance(n, tuple) else (n,), dims, init=how, dtype=dtype)

    def layer():
        p = clip.layer_params(v, w, vec)
        if not v.attention_bias:
            p["self_attn"] = {k: x for k, x in p["self_attn"].items() if k not in ("q_bias", "k_bias", "v_bias")}
        return {**p, "lambda_1": vec(v.hidden, "vision", "ones"), "lambda_2": vec(v.hidden, "vision", "ones")}

    tower = {"embeddings": {"patch_embeddings": w((v.hidden, v.channels, v.patch_size, v.patch_size),
                                                  "vision channel patch_y patch_x"),
                            "patch_embeddings_bias": vec(v.hidden, "vision", "zeros"),
                            "cls_token": w((v.hidden,), "vision"),
                            "position_embeddings": w((v.grid ** 2 + 1, v.hidden), "vpos vision")},
             "encoder": {"layer": [layer() for _ in range(v.used_layers)]}}
    if v.final_norm and v.feature_layer == -1:
        tower.update(layernorm=vec(v.hidden, "vision", "ones"), layernorm_bias=vec(v.hidden, "vision", "zeros"))
    return {"vision_tower": tower, "multi_modal_projector": lfm2_vl.projector_params(v, text_hidden, w, vec)}


def encode(tower: dict, images: dict, v: InternVLConfig) -> Named:
    """The hidden states (batch patch vision) after :attr:`InternVLConfig.used_layers` layers, class slots included."""
    e = tower["embeddings"]
    dtype = e["patch_embeddings"].data.dtype
    row, col = ops.unbind(images["patch_positions"], "axis")
    is_class = col.map(lambda t: (t < 0).to(dtype))
    x = ops.einsum("batch patch channel patch_y patch_x, vision channel patch_y patch_x -> batch patch vision",
                   images["patches"].astype(dtype), e["patch_embeddings"])
    x = x + (1.0 - is_class) * e["patch_embeddings_bias"] + is_class * e["cls_token"]
    x = x + ops.embed(e["position_embeddings"], row * v.grid + col + 1, vocab="vpos")
    for p in tower["encoder"]["layer"]:
        x = clip.encoder_layer(p, x, images["patch_images"], v)
    return ops.layer_norm(x, tower["layernorm"], tower["layernorm_bias"], eps=v.norm_eps) if "layernorm" in tower else x


def with_images(params: dict, x: Named, images: dict, v: InternVLConfig) -> Named:
    """The token embeddings ``x`` (batch seq hidden) with the projected tile features written at the image
    tokens (the class slots, after the tiles' patches, make merged tokens no image token takes)."""
    n = images["patches"].size("patch")
    if n % (v.merge ** 2):
        raise ValueError(f"image inputs: {n} patches per example is not a multiple of (1 / downsample_ratio)² = "
                         f"{v.merge ** 2} (data/images.py pads them so)")
    features = lfm2_vl.project(params["multi_modal_projector"], encode(params["vision_tower"], images, v), v)
    return ops.masked_scatter(x, features.astype(x.data.dtype), images["image_slots"], "merged")


VISION_CONFIG = InternVLConfig
"""The config class of this tower (models/llama.py's ``vision_tower``)."""
