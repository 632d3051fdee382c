"""Images into a Qwen decoder: the vision tower of Qwen3-VL / Qwen3.5 (transformers'
``Qwen3_5VisionModel``: its patch merger is the projector) and Qwen2-VL's (``Qwen2VisionTransformerPretrainedModel``:
the same without the convolution's bias and the learned positions, a QuickGELU MLP) as pure
functions over named arrays, the same entries and mechanism as models/pixtral.py (one tower of
``Config.vision``).

The data path (``data/qwen_images.py``) gives each example's patches as Qwen's image processor
cuts them (``patches``: batch patch channel patch_y patch_x, the channels ``in_channels x
temporal_patch_size``; each ``merge``² consecutive patches one merged token), their row and column
(``patch_positions``), their image (``patch_images``), the image tokens' merged tokens
(``image_slots``), the taps and weights of the learned position table's bilinear resampling to
each image's grid (``patch_taps``, ``patch_tap_weights``: batch patch tap) and the text's
multimodal rotary positions (``mrope_positions``: batch seq mrope; the decoder's, ops.rotary's
``sections``). The tower: the patch convolution (a Conv3d over temporal x patch x patch, as a
contraction), plus the resampled position table, then blocks of LayerNorm, attention inside each
image (a block-diagonal mask) with a 2D rotary (a quarter of the head's frequencies for the row,
the same for the column, rotate-half), and a linear-GELU(tanh)-linear MLP; the merger normalises,
concatenates ``merge``² neighbours and maps them by linear-GELU-linear to the decoder's width."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models.pixtral import _rotate
from functional_pp.parallel.named import Named
from functional_pp.parallel.reshard import named

TOWER = "qwen3_vl"
TOWERS = (TOWER, "qwen2_vl", "paddleocr_vl")
"""The tower names this module builds (Qwen3-VL / Qwen3.5's; Qwen2-VL's; PaddleOCR-VL's NaViT SigLIP:
Qwen3-VL's with one frame per patch, a LayerNorm after the last block and the position table
resampled at half-pixel centres)."""
EXTRA_KEYS = ("patch_taps", "patch_tap_weights", "mrope_positions")
"""The batch entries this tower reads beside models/pixtral.py's ``IMAGE_KEYS`` (its ``EXTRA_KEYS``)."""


ACTIVATIONS = {"gelu_pytorch_tanh": lambda h: ops.gelu(h, approximate="tanh"), "gelu": ops.gelu,
               "quick_gelu": lambda h: h.map(lambda t: t * torch.sigmoid(1.702 * t)), "silu": ops.silu}
"""The vision MLP's activations (``hidden_act``; QuickGELU: Qwen2-VL's; SiLU: GLM-4V's gated MLPs)."""


@dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen3-VL / Qwen3.5's ``vision_config`` (``depth``, ``num_heads``, ``out_hidden_size`` the
    decoder's width) and the multimodal config's ``image_token_id``."""

    hidden: int = 1152
    layers: int = 27
    heads: int = 16
    mlp: int = 4304
    patch_size: int = 16
    temporal_patch: int = 2
    channels: int = 3
    merge: int = 2
    positions: int = 2304              # num_position_embeddings: a square table, side x side (0: none, Qwen2-VL)
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"
    image_token_id: int = 248056
    tower: str = TOWER
    patch_bias: bool = True            # (Qwen2-VL: its patch convolution has no bias)
    post_norm: bool = False            # (PaddleOCR-VL: a LayerNorm after the last block, post_layernorm)
    merger_eps: float = 1e-6           # the merger's LayerNorm epsilon (PaddleOCR-VL's projector: 1e-5)
    align_corners: bool = True         # the position table's resampling (PaddleOCR-VL: half-pixel, False)


    def __post_init__(self) -> None:
        side = int(self.positions ** 0.5)
        if side * side != self.positions:
            raise ValueError(f"vision_config: num_position_embeddings={self.positions} must be a square (the "
                             f"learned position grid is side x side)")
        if self.hidden % self.heads or (self.hidden // self.heads) % 4:
            raise ValueError(f"vision_config: hidden_size={self.hidden} must be num_heads={self.heads} times a head "
                             f"width divisible by 4 (the 2D rotary: a quarter each for rows and columns, twice)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config: hidden_act={self.hidden_act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def resample(self) -> str:
        """The position table's resampling (data/qwen_images.py's ``RESAMPLING``)."""
        return "bilinear" if self.align_corners else "bilinear_half"

    @property
    def side(self) -> int:
        """The learned position grid's side (``num_grid_per_side``)."""
        return int(self.positions ** 0.5)


def init(v: QwenVisionConfig, text_hidden: int, dtype: torch.dtype, std: float) -> dict:
    """The declarations of the tower (``vision_tower``) and its patch merger (``multi_modal_projector``)."""
    D, H, M = v.head_dim, v.heads, v.hidden * v.merge ** 2

    def w(shape, dims):
        return param(shape, dims, init="normal", scale=std, dtype=dtype)

    def ones(n, dims):
        return param((n,), dims, init="ones", dtype=dtype)

    def zeros(shape, dims):
        return param(shape, dims, init="zeros", dtype=dtype)

    def block():
        attn = {f"{x}_proj": w((v.hidden, H, D), "vision vheads vhead_dim") for x in "qkv"}
        attn.update({f"{x}_bias": zeros((H, D), "vheads vhead_dim") for x in "qkv"})
        attn.update(o_proj=w((H, D, v.hidden), "vheads vhead_dim vision"), o_bias=zeros((v.hidden,), "vision"))
        return {"norm1": ones(v.hidden, "vision"), "norm1_bias": zeros((v.hidden,), "vision"),
                "norm2": ones(v.hidden, "vision"), "norm2_bias": zeros((v.hidden,), "vision"), "attn": attn,
                "mlp": {"fc1": w((v.hidden, v.mlp), "vision vmlp"), "fc1_bias": zeros((v.mlp,), "vmlp"),
                        "fc2": w((v.mlp, v.hidden), "vmlp vision"), "fc2_bias": zeros((v.hidden,), "vision")}}

    tower = {"patch_embed": w((v.hidden, v.channels, v.temporal_patch, v.patch_size, v.patch_size),
                              "vision channel patch_t patch_y patch_x"),
             "blocks": [block() for _ in range(v.layers)]}
    if v.patch_bias:
        tower["patch_bias"] = zeros((v.hidden,), "vision")
    if v.positions:
        tower["pos_embed"] = w((v.positions, v.hidden), "vpositions vision")
    if v.post_norm:
        tower.update(post_norm=ones(v.hidden, "vision"), post_norm_bias=zeros((v.hidden,), "vision"))
    merger = {"ln": ones(v.hidden, "vision"), "ln_bias": zeros((v.hidden,), "vision"),
              "fc1": w((M, M), "vision_merge mm"), "fc1_bias": zeros((M,), "mm"),
              "fc2": w((M, text_hidden), "mm hidden"), "fc2_bias": zeros((text_hidden,), "hidden")}
    return {"vision_tower": tower, "multi_modal_projector": merger}


def _rotary_tables(pos: Named, v: QwenVisionConfig, dtype: torch.dtype) -> tuple[Named, Named]:
    """cos and sin (batch patch vhead_dim): the inverse frequencies of half the head width, times the
    patch's row for the first quarter, its column for the second, that half twice (rotate-half
    order), in float32 as transformers computes them."""
    half = v.head_dim // 2
    inv = 1.0 / (v.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    zeros = torch.zeros(half // 2)
    table = torch.stack([torch.cat([inv, zeros] * 2), torch.cat([zeros, inv] * 2)])
    angles = ops.einsum("batch patch axis, axis vhead_dim -> batch patch vhead_dim", pos.astype(torch.float),
                        named(table.to(pos.data.device), "axis vhead_dim"))
    return ops.cos(angles).astype(dtype), ops.sin(angles).astype(dtype)


def attend(a: dict, h: Named, cos: Named, sin: Named, segments: Named, v) -> Named:
    """The tower's attention of normed patches ``h`` (batch patch vision) inside each image
    (``segments``): q, k and v (their biases where ``a`` has them), the 2D rotary, the output
    projection (and its bias); Qwen's and GLM-4V's towers (models/glm4v_vision.py) alike."""
    def proj(role):
        x = ops.einsum("batch patch vision, vision vheads vhead_dim -> batch patch vheads vhead_dim", h,
                       a[f"{role}_proj"])
        return x + a[f"{role}_bias"] if f"{role}_bias" in a else x
    q, k = _rotate(proj("q"), cos, sin, v.head_dim), _rotate(proj("k"), cos, sin, v.head_dim)
    o = ops.attention(q, k, proj("v"), causal=False, batch="batch", seq="patch", heads="vheads", kv_heads="vheads",
                      head_dim="vhead_dim", segments=segments)
    o = ops.einsum("batch patch vheads vhead_dim, vheads vhead_dim vision -> batch patch vision", o, a["o_proj"])
    return o + a["o_bias"] if "o_bias" in a else o


def _block(p: dict, x: Named, cos: Named, sin: Named, segments: Named, v: QwenVisionConfig) -> Named:
    h = ops.layer_norm(x, p["norm1"], p["norm1_bias"], eps=1e-6)
    x = x + attend(p["attn"], h, cos, sin, segments, v)
    f = p["mlp"]
    h = ops.layer_norm(x, p["norm2"], p["norm2_bias"], eps=1e-6)
    h = ops.einsum("batch patch vision, vision vmlp -> batch patch vmlp", h, f["fc1"]) + f["fc1_bias"]
    h = ACTIVATIONS[v.hidden_act](h)
    return x + ops.einsum("batch patch vmlp, vmlp vision -> batch patch vision", h, f["fc2"]) + f["fc2_bias"]


def patch_embedding(tower: dict, images: dict, v) -> Named:
    """The patch convolution (a Conv3d over temporal x patch x patch, as a contraction; its bias
    where the tower has one) of the batch's patches: batch patch vision."""
    dtype = tower["patch_embed"].data.dtype
    patches = ops.split_dim(images["patches"].astype(dtype), "channel",
                            {"pchannel": v.channels, "patch_t": v.temporal_patch})
    x = ops.einsum("batch patch pchannel patch_t patch_y patch_x, vision pchannel patch_t patch_y patch_x -> "
                   "batch patch vision", patches, ops.rename(tower["patch_embed"], channel="pchannel"))
    return x + tower["patch_bias"] if "patch_bias" in tower else x


def learned_positions(table: Named, images: dict) -> Named:
    """The learned position table (vpositions vision) resampled to each patch: its rows
    ``patch_taps`` weighted by ``patch_tap_weights`` (bilinear: 4 taps; bicubic: 16)."""
    rows = ops.embed(table, images["patch_taps"], vocab="vpositions")      # batch patch tap vision
    return ops.einsum("batch patch tap vision, batch patch tap -> batch patch vision", rows,
                      images["patch_tap_weights"].astype(table.data.dtype))


def encode(tower: dict, images: dict, v: QwenVisionConfig) -> Named:
    """The tower's last hidden states (batch patch vision) of the batch's patches."""
    x = patch_embedding(tower, images, v)
    if "pos_embed" in tower:
        x = x + learned_positions(tower["pos_embed"], images)
    cos, sin = _rotary_tables(images["patch_positions"], v, x.data.dtype)
    for p in tower["blocks"]:
        x = _block(p, x, cos, sin, images["patch_images"], v)
    if "post_norm" in tower:
        x = ops.layer_norm(x, tower["post_norm"], tower["post_norm_bias"], eps=1e-6)
    return x


def project(merger: dict, x: Named, v: QwenVisionConfig) -> Named:
    """The patch merger (batch merged hidden): LayerNorm, each ``merge``² consecutive patches'
    vectors one after the other, linear-GELU-linear."""
    k = v.merge ** 2
    x = ops.layer_norm(x, merger["ln"], merger["ln_bias"], eps=v.merger_eps)
    x = ops.split_dim(x, "patch", {"merged": x.size("patch") // k, "merge": k})
    x = ops.merge_dims(ops.transpose(x, "batch", "merged", "merge", "vision"), ("merge", "vision"), "vision_merge")
    h = ops.einsum("batch merged vision_merge, vision_merge mm -> batch merged mm", x, merger["fc1"])
    h = h + merger["fc1_bias"]
    return ops.einsum("batch merged mm, mm hidden -> batch merged hidden", ops.gelu(h), merger["fc2"]) + \
        merger["fc2_bias"]


def with_images(params: dict, x: Named, images: dict, v: QwenVisionConfig) -> Named:
    """The token embeddings ``x`` (batch seq hidden) with the merged image features written at the
    image tokens."""
    missing = [k for k in EXTRA_KEYS[:2] if k not in images] if v.positions else []
    if missing:
        raise ValueError(f"image inputs: the {v.tower} tower needs {missing} too (data/qwen_images.py's "
                         f"qwen_image_batch makes them)")
    return write_merged(params, x, images, v, encode, project)


def write_merged(params: dict, x: Named, images: dict, v: Any, encode: Callable, project: Callable) -> Named:
    """``x`` with the features of a tower that merges ``v.merge``² patches per token (``encode``
    then ``project``: Qwen's, GLM-4V's) written at the image tokens; the patches per example
    must be a multiple of the merge."""
    n = images["patches"].size("patch")
    if n % (v.merge ** 2):
        raise ValueError(f"image inputs: {n} patches per example is not a multiple of spatial_merge_size² = "
                         f"{v.merge ** 2} (data/qwen_images.py pads them so)")
    features = project(params["multi_modal_projector"], encode(params["vision_tower"], images, v), v)
    return ops.masked_scatter(x, features.astype(x.data.dtype), images["image_slots"], "merged")


VISION_CONFIG = QwenVisionConfig
"""The config class of this tower (models/llama.py's ``vision_tower``)."""
