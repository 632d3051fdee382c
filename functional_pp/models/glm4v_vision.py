"""Images into a GLM-4 decoder: the vision tower of GLM-4.1V / GLM-4.6V (transformers'
``Glm4vVisionModel``, its patch merger the projector) as pure functions over named arrays, one more
entry of the towers of ``Config.vision`` (models/llama.py's ``vision_tower``).

It is Qwen's tower (models/qwen_vision.py: its patch convolution, the learned position table
resampled to each image's grid through ``patch_taps`` / ``patch_tap_weights``, the attention inside
each image with the 2D rotary) with GLM's pieces around it: an RMSNorm after the patch convolution
(the positions added after it, resampled bicubically: 16 taps, data/qwen_images.py), RMSNorm blocks
with a gated MLP (SiLU; no biases) as wide as the decoder, an RMSNorm after the blocks, a
downsampling convolution over each ``merge`` x ``merge`` block of patches to the decoder's width,
and a merger of a linear map, LayerNorm, GELU and a gated MLP."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models import qwen_vision
from functional_pp.parallel.named import Named

TOWER = "glm4v"
TOWERS = (TOWER,)
"""The tower names this module builds."""


@dataclass(frozen=True)
class Glm4vVisionConfig:
    """GLM-4V's ``vision_config`` (``depth``, ``num_heads``; ``out_hidden_size`` the decoder's width,
    the blocks' MLP's and the downsampling's; ``intermediate_size`` the merger's MLP) and the
    multimodal config's ``image_token_id``."""

    hidden: int = 1536
    layers: int = 24
    heads: int = 12
    out_hidden: int = 4096
    merger_mlp: int = 13696
    patch_size: int = 14
    temporal_patch: int = 2
    channels: int = 3
    merge: int = 2
    positions: int = 576               # (image_size / patch_size)²: the learned position table, side x side
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    norm_eps: float = 1e-5
    attention_bias: bool = False
    image_token_id: int = 151343
    tower: str = TOWER

    resample = "bicubic"               # (the position table's resampling: data/qwen_images.py)

    def __post_init__(self) -> None:
        side = int(self.positions ** 0.5)
        if side * side != self.positions or not side:
            raise ValueError(f"vision_config: (image_size / patch_size)² = {self.positions} must be a positive "
                             f"square (the learned position grid is side x side)")
        if self.hidden % self.heads or (self.hidden // self.heads) % 4:
            raise ValueError(f"vision_config: hidden_size={self.hidden} must be num_heads={self.heads} times a head "
                             f"width divisible by 4 (the 2D rotary: a quarter each for rows and columns, twice)")
        if self.hidden_act not in qwen_vision.ACTIVATIONS:
            raise ValueError(f"vision_config: hidden_act={self.hidden_act!r} is not supported "
                             f"({', '.join(qwen_vision.ACTIVATIONS)})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def side(self) -> int:
        """The learned position grid's side."""
        return int(self.positions ** 0.5)


def init(v: Glm4vVisionConfig, text_hidden: int, dtype: torch.dtype, std: float) -> dict:
    """The declarations of the tower (``vision_tower``) and its merger (``multi_modal_projector``)."""
    if v.out_hidden != text_hidden:
        raise ValueError(f"vision_config: out_hidden_size={v.out_hidden} (the merger's output) is not the text "
                         f"decoder's hidden_size={text_hidden}")
    D, H, m = v.head_dim, v.heads, v.merge

    def w(shape, dims):
        return param(shape, dims, init="normal", scale=std, dtype=dtype)

    def ones(n, dims):
        return param((n,), dims, init="ones", dtype=dtype)

    def block():
        attn = {f"{x}_proj": w((v.hidden, H, D), "vision vheads vhead_dim") for x in "qkv"}
        if v.attention_bias:
            attn.update({f"{x}_bias": param((H, D), "vheads vhead_dim", init="zeros", dtype=dtype) for x in "qkv"})
        # (meta in_dims: the leading dimensions a linear contracts, docs/adapters.md)
        attn["o_proj"] = dataclasses.replace(w((H, D, v.hidden), "vheads vhead_dim vision"), meta={"in_dims": 2})
        return {"norm1": ones(v.hidden, "vision"), "norm2": ones(v.hidden, "vision"), "attn": attn,
                "mlp": {"gate_proj": w((v.hidden, v.out_hidden), "vision vmlp"),
                        "up_proj": w((v.hidden, v.out_hidden), "vision vmlp"),
                        "down_proj": w((v.out_hidden, v.hidden), "vmlp vision")}}

    tower = {"patch_embed": w((v.hidden, v.channels, v.temporal_patch, v.patch_size, v.patch_size),
                              "vision channel patch_t patch_y patch_x"),
             "patch_bias": param((v.hidden,), "vision", init="zeros", dtype=dtype),
             "post_conv_norm": ones(v.hidden, "vision"),
             "pos_embed": w((v.positions, v.hidden), "vpositions vision"),
             "blocks": [block() for _ in range(v.layers)],
             "post_norm": ones(v.hidden, "vision"),
             "downsample": w((v.out_hidden, v.hidden, m, m), "vout vision merge_y merge_x"),
             "downsample_bias": param((v.out_hidden,), "vout", init="zeros", dtype=dtype)}
    merger = {"proj": w((v.out_hidden, text_hidden), "vout hidden"), "ln": ones(text_hidden, "hidden"),
              "ln_bias": param((text_hidden,), "hidden", init="zeros", dtype=dtype),
              "gate_proj": w((text_hidden, v.merger_mlp), "hidden mm"),
              "up_proj": w((text_hidden, v.merger_mlp), "hidden mm"), "down_proj": w((v.merger_mlp, text_hidden), "mm hidden")}
    return {"vision_tower": tower, "multi_modal_projector": merger}


def _block(p: dict, x: Named, cos: Named, sin: Named, segments: Named, v: Glm4vVisionConfig) -> Named:
    h = ops.rms_norm(x, p["norm1"], eps=v.norm_eps)
    x = x + qwen_vision.attend(p["attn"], h, cos, sin, segments, v)
    f = p["mlp"]
    h = ops.rms_norm(x, p["norm2"], eps=v.norm_eps)
    gate = ops.einsum("batch patch vision, vision vmlp -> batch patch vmlp", h, f["gate_proj"])
    up = ops.einsum("batch patch vision, vision vmlp -> batch patch vmlp", h, f["up_proj"])
    return x + ops.einsum("batch patch vmlp, vmlp vision -> batch patch vision", qwen_vision.ACTIVATIONS[v.hidden_act](gate) * up,
                          f["down_proj"])


def encode(tower: dict, images: dict, v: Glm4vVisionConfig) -> Named:
    """The tower's output (batch merged vout): patches embedded, normed, given their resampled
    positions, through the blocks, normed, each ``merge`` x ``merge`` block of patches (``merge``²
    consecutive patches, row-major) downsampled by the convolution to one merged token."""
    x = ops.rms_norm(qwen_vision.patch_embedding(tower, images, v), tower["post_conv_norm"], eps=v.norm_eps)
    x = x + qwen_vision.learned_positions(tower["pos_embed"], images)
    cos, sin = qwen_vision._rotary_tables(images["patch_positions"], v, x.data.dtype)
    for p in tower["blocks"]:
        x = _block(p, x, cos, sin, images["patch_images"], v)
    x = ops.rms_norm(x, tower["post_norm"], eps=v.norm_eps)
    k = v.merge ** 2
    x = ops.split_dim(x, "patch", {"merged": x.size("patch") // k, "merge_y": v.merge, "merge_x": v.merge})
    return ops.einsum("batch merged merge_y merge_x vision, vout vision merge_y merge_x -> batch merged vout", x,
                      tower["downsample"]) + tower["downsample_bias"]


def project(merger: dict, x: Named, v: Glm4vVisionConfig) -> Named:
    """The merger (batch merged hidden): linear, LayerNorm, GELU, then a gated MLP."""
    h = ops.einsum("batch merged vout, vout hidden -> batch merged hidden", x, merger["proj"])
    h = ops.gelu(ops.layer_norm(h, merger["ln"], merger["ln_bias"], eps=1e-5))
    gate = ops.einsum("batch merged hidden, hidden mm -> batch merged mm", h, merger["gate_proj"])
    up = ops.einsum("batch merged hidden, hidden mm -> batch merged mm", h, merger["up_proj"])
    return ops.einsum("batch merged mm, mm hidden -> batch merged hidden", qwen_vision.ACTIVATIONS[v.hidden_act](gate) * up,
                      merger["down_proj"])


def with_images(params: dict, x: Named, images: dict, v: Glm4vVisionConfig) -> Named:
    """The token embeddings ``x`` (batch seq hidden) with the merged image features written at the
    image tokens."""
    missing = [k for k in qwen_vision.EXTRA_KEYS[:2] if k not in images]
    if missing:
        raise ValueError(f"image inputs: the {v.tower} tower needs {missing} too (data/qwen_images.py's "
                         f"qwen_image_batch makes them, resample='bicubic')")
    taps = images["patch_taps"].size("tap")
    if taps != 16:
        raise ValueError(f"image inputs: the {v.tower} tower resamples its position table bicubically (16 taps per "
                         f"patch), the batch has {taps}: make it with qwen_image_batch(..., resample='bicubic')")
    return qwen_vision.write_merged(params, x, images, v, encode, project)


VISION_CONFIG = Glm4vVisionConfig
"""The config class of this tower (models/llama.py's ``vision_tower``)."""
