"""Images into Llama 4's decoder: its vision model (transformers' ``Llama4VisionModel``: the
patch embedding, encoder, pixel shuffle and adapter MLP) and ``Llama4MultiModalProjector`` as pure
functions over named arrays: one tower of ``Config.vision`` (models/llama.py's ``vision_tower``),
the same entries and scatter as models/pixtral.py.

Llama4Processor cuts each image into tiles of ``image_size`` pixels (and, for more than one, a
global tile of the whole image); the tower sees each tile alone. The data path
(data/images.py's ``image_batch`` with ``class_token="trailing"``) gives each tile's patches in the
merge order (each ``merge``² consecutive patches one merged token), then the tile's class token
slot (zero pixels, position (0, -1)); ``patch_images`` numbers the tiles (attention stays inside
each) and every example's patches are whole tiles (pads too). The tower: the unfold patch
embedding (a linear of the patch's pixels, channels first), the class embedding at the class
slots, the learned position of each patch (``row * grid + column``; the class token the last),
LayerNorm, encoder layers of LayerNorm, attention with biases and Llama 4's vision 2D rotary
(complex pairs: the first quarter of the head's pairs turned by the column + 1, the second by the
row + 1, the class token not at all; in float32, as transformers), and a GELU MLP; LayerNorm, the
class slots dropped, the pixel shuffle (each ``merge``² neighbours concatenated: the row in the
merge, its column, then the channels) and the adapter MLP (linear-GELU-linear-GELU, no biases),
then the projector's linear to the decoder's width."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.parallel.named import Named
from functional_pp.parallel.reshard import named

TOWER = "llama4"
TOWERS = (TOWER,)
"""The tower names this module builds."""


@dataclass(frozen=True)
class Llama4VisionConfig:
    """Llama 4's ``vision_config`` (``intermediate_size`` the encoder MLP's width; the adapter MLP reads
    ``hidden * merge²`` and writes ``projector_output_dim``; ``merge`` is ``1 / pixel_shuffle_ratio``)
    and the multimodal config's ``image_token_index`` (``<|patch|>``)."""

    hidden: int = 1408
    layers: int = 34
    heads: int = 16
    mlp: int = 5632
    patch_size: int = 14
    channels: int = 3
    image_size: int = 336
    rope_theta: float = 10000.0
    merge: int = 2
    projector_dim: int = 4096          # projector_input_dim = projector_output_dim = vision_output_dim
    norm_eps: float = 1e-5
    image_token_id: int = 200092
    tower: str = TOWER

    def __post_init__(self) -> None:
        grid = self.image_size // self.patch_size
        if self.image_size % self.patch_size or grid % self.merge:
            raise ValueError(f"llama4 vision_config: image_size={self.image_size} must be a whole number of "
                             f"patch_size={self.patch_size} patches each way, a multiple of 1 / pixel_shuffle_ratio "
                             f"= {self.merge}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 4:
            raise ValueError(f"llama4 vision_config: hidden_size={self.hidden} must be num_attention_heads="
                             f"{self.heads} times a head width divisible by 4 (the 2D rotary: a quarter of the "
                             f"pairs each for columns and rows)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def grid(self) -> int:
        """Patches per tile side."""
        return self.image_size // self.patch_size


def init(v: Llama4VisionConfig, text_hidden: int, dtype: torch.dtype, std: float) -> dict:
    """The declarations of the vision model (``vision_tower``) and the projector (``multi_modal_projector``)."""
    D, H = v.head_dim, v.heads

    def w(shape, dims):
        return param(shape, dims, init="normal", scale=std, dtype=dtype)

    def vec(shape, dims, how):
        return param(shape, dims, init=how, dtype=dtype)

    def layer():
        attn = {f"{x}_proj": w((v.hidden, H, D), "vision vheads vhead_dim") for x in "qkv"}
        attn.update({f"{x}_bias": vec((H, D), "vheads vhead_dim", "zeros") for x in "qkv"})
        attn.update(o_proj=dataclasses.replace(w((H, D, v.hidden), "vheads vhead_dim vision"), meta={"in_dims": 2}),
                    o_bias=vec((v.hidden,), "vision", "zeros"))     # (in_dims: what LoRA's lora_A contracts)
        return {"input_layernorm": vec((v.hidden,), "vision", "ones"),
                "input_layernorm_bias": vec((v.hidden,), "vision", "zeros"),
                "post_attention_layernorm": vec((v.hidden,), "vision", "ones"),
                "post_attention_layernorm_bias": vec((v.hidden,), "vision", "zeros"), "self_attn": attn,
                "mlp": {"fc1": w((v.hidden, v.mlp), "vision vmlp"), "fc1_bias": vec((v.mlp,), "vmlp", "zeros"),
                        "fc2": w((v.mlp, v.hidden), "vmlp vision"), "fc2_bias": vec((v.hidden,), "vision", "zeros")}}

    pixels = v.channels * v.patch_size ** 2
    tower = {"patch_linear": w((pixels, v.hidden), "vpixel vision"), "class_token": w((v.hidden,), "vision"),
             "positional_embedding_vlm": w((v.grid ** 2 + 1, v.hidden), "vpos vision"),
             "layernorm_pre": vec((v.hidden,), "vision", "ones"),
             "layernorm_pre_bias": vec((v.hidden,), "vision", "zeros"),
             "layernorm_post": vec((v.hidden,), "vision", "ones"),
             "layernorm_post_bias": vec((v.hidden,), "vision", "zeros"),
             "encoder_layers": [layer() for _ in range(v.layers)],
             "vision_adapter": {"mlp": {"fc1": w((v.hidden * v.merge ** 2, v.projector_dim), "vision_merge mm"),
                                        "fc2": w((v.projector_dim, v.projector_dim), "mm vadapter")}}}
    projector = {"linear_1": w((v.projector_dim, text_hidden), "vadapter hidden")}
    return {"vision_tower": tower, "multi_modal_projector": projector}


def _rotary_tables(pos: Named, v: Llama4VisionConfig) -> tuple[Named, Named]:
    """cos and sin (batch patch vpair, float32) of each complex pair: pair i < D/4 turned by
    (column + 1) * f_i, pair D/4 + i by (row + 1) * f_i, f_i = theta^(-4i / D); class slots 0."""
    D = v.head_dim
    freq = 1.0 / (v.rope_theta ** (torch.arange(0, D // 2, 2)[: D // 4].float() / (D // 2)))
    zeros = torch.zeros(D // 4)
    table = torch.stack([torch.cat([zeros, freq]), torch.cat([freq, zeros])])     # (row, column) x pair
    is_patch = ops.unbind(pos, "axis")[1].map(lambda t: (t >= 0).to(torch.float))
    angles = ops.einsum("batch patch axis, axis vpair -> batch patch vpair", (pos + 1).astype(torch.float),
                        named(table.to(pos.data.device), "axis vpair")) * is_patch
    return ops.cos(angles), ops.sin(angles)


def _rotate(x: Named, cos: Named, sin: Named, v: Llama4VisionConfig) -> Named:
    """Each adjacent pair (2i, 2i + 1) of ``vhead_dim`` times the complex cos_i + j sin_i, in float32."""
    dtype = x.data.dtype
    pairs = ops.split_dim(x.astype(torch.float), "vhead_dim", {"vpair": v.head_dim // 2, "vtwo": 2})
    re, im = ops.slice_dim(pairs, "vtwo", 0, 1), ops.slice_dim(pairs, "vtwo", 1, 2)
    out = ops.concat([re * cos - im * sin, re * sin + im * cos], "vtwo")
    out = ops.transpose(out, *[d for d in pairs.dims])
    return ops.merge_dims(out, ("vpair", "vtwo"), "vhead_dim").astype(dtype)


def _layer(p: dict, x: Named, cos: Named, sin: Named, segments: Named, v: Llama4VisionConfig) -> Named:
    a = p["self_attn"]
    h = ops.layer_norm(x, p["input_layernorm"], p["input_layernorm_bias"], eps=v.norm_eps)

    def proj(role):
        return ops.einsum("batch patch vision, vision vheads vhead_dim -> batch patch vheads vhead_dim", h,
                          a[f"{role}_proj"]) + a[f"{role}_bias"]
    q, k = _rotate(proj("q"), cos, sin, v), _rotate(proj("k"), cos, sin, v)
    o = ops.attention(q, k, proj("v"), causal=False, batch="batch", seq="patch", heads="vheads", kv_heads="vheads",
                      head_dim="vhead_dim", segments=segments)
    x = x + ops.einsum("batch patch vheads vhead_dim, vheads vhead_dim vision -> batch patch vision", o,
                       a["o_proj"]) + a["o_bias"]
    m = p["mlp"]
    h = ops.layer_norm(x, p["post_attention_layernorm"], p["post_attention_layernorm_bias"], eps=v.norm_eps)
    h = ops.gelu(ops.einsum("batch patch vision, vision vmlp -> batch patch vmlp", h, m["fc1"]) + m["fc1_bias"])
    return x + ops.einsum("batch patch vmlp, vmlp vision -> batch patch vision", h, m["fc2"]) + m["fc2_bias"]


def encode(tower: dict, images: dict, v: Llama4VisionConfig) -> Named:
    """The encoder's normed last hidden states (batch patch vision), class slots included."""
    dtype = tower["layernorm_pre"].data.dtype
    pixels = ops.merge_dims(images["patches"].astype(dtype), ("channel", "patch_y", "patch_x"), "vpixel")
    x = ops.einsum("batch patch vpixel, vpixel vision -> batch patch vision", pixels, tower["patch_linear"])
    row, col = ops.unbind(images["patch_positions"], "axis")
    is_class = col.map(lambda t: (t < 0).to(dtype))
    x = x + is_class * tower["class_token"]
    index = (row * v.grid + col).map(lambda t: torch.where(t < 0, v.grid ** 2, t))     # (the class token: last)
    x = x + ops.embed(tower["positional_embedding_vlm"], index, vocab="vpos")
    x = ops.layer_norm(x, tower["layernorm_pre"], tower["layernorm_pre_bias"], eps=v.norm_eps)
    cos, sin = _rotary_tables(images["patch_positions"], v)
    for p in tower["encoder_layers"]:
        x = _layer(p, x, cos, sin, images["patch_images"], v)
    return ops.layer_norm(x, tower["layernorm_post"], tower["layernorm_post_bias"], eps=v.norm_eps)


def project(tower: dict, proj: dict, x: Named, v: Llama4VisionConfig) -> Named:
    """The class slots dropped, the pixel shuffle, the adapter MLP and the projector (batch merged hidden)."""
    per, k = v.grid ** 2, v.merge ** 2
    tiles = ops.split_dim(x, "patch", {"tile": x.size("patch") // (per + 1), "tpatch": per + 1})
    x = ops.merge_dims(ops.slice_dim(tiles, "tpatch", 0, per), ("tile", "tpatch"), "patch")
    x = ops.split_dim(x, "patch", {"merged": x.size("patch") // k, "merge": k})
    x = ops.merge_dims(ops.transpose(x, "batch", "merged", "merge", "vision"), ("merge", "vision"), "vision_merge")
    a = tower["vision_adapter"]["mlp"]
    h = ops.gelu(ops.einsum("batch merged vision_merge, vision_merge mm -> batch merged mm", x, a["fc1"]))
    h = ops.gelu(ops.einsum("batch merged mm, mm vadapter -> batch merged vadapter", h, a["fc2"]))
    return ops.einsum("batch merged vadapter, vadapter hidden -> batch merged hidden", h, proj["linear_1"])


def with_images(params: dict, x: Named, images: dict, v: Llama4VisionConfig) -> Named:
    """The token embeddings ``x`` (batch seq hidden) with the projected tile features written at the
    image tokens (``<|patch|>``)."""
    n, per = images["patches"].size("patch"), v.grid ** 2 + 1
    if n % per:
        raise ValueError(f"image inputs: {n} patches per example is not a whole number of llama4 tiles of {per} "
                         f"({v.grid}² patches and a class slot; data/images.py's image_batch with "
                         f"class_token='trailing' pads them so)")
    tower = params["vision_tower"]
    features = project(tower, params["multi_modal_projector"], encode(tower, images, v), v)
    return ops.masked_scatter(x, features.astype(x.data.dtype), images["image_slots"], "merged")


VISION_CONFIG = Llama4VisionConfig
"""The config class of this tower (models/llama.py's ``vision_tower``)."""
