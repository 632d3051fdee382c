"""Images into an LFM2 decoder: LFM2-VL's SigLIP2 NaFlex tower (models/siglip2.py) and its projector
(transformers' ``Lfm2VlMultiModalProjector``) as pure functions over named arrays, the same entries
and mechanism as models/pixtral.py (one tower of ``Config.vision``).

The data path (data/siglip2_images.py) gives each example's patches in merge order (each
``merge``² consecutive patches, a ``merge x merge`` block of its image read row by row, one image
token), with the position table's taps. The projector is the pixel unshuffle (each block's
``merge``² patch vectors one after the other), a LayerNorm over them (``projector_use_layernorm``),
then linear-GELU-linear to the decoder's width (``projector_hidden_size`` between, biases with
``projector_bias``); the features are written at the image tokens by ``ops.masked_scatter``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models import clip, siglip2
from functional_pp.parallel.named import Named

TOWER = "siglip2"
TOWERS = (TOWER,)
"""The tower names this module builds."""
NEEDS = ("patch_taps", "patch_tap_weights")
"""The batch entries the tower reads beside models/pixtral.py's ``IMAGE_KEYS``."""


@dataclass(frozen=True)
class Lfm2VlConfig:
    """LFM2-VL's ``vision_config`` (a ``siglip2_vision_model``: ``num_patches`` the learned position
    table's size, a square) and projector (``downsample_factor`` the merge, ``projector_hidden_size``,
    ``projector_bias``, ``projector_use_layernorm``, ``projector_hidden_act``); ``image_token_id``."""

    hidden: int = 1152
    layers: int = 27
    heads: int = 16
    mlp: int = 4304
    patch_size: int = 16
    channels: int = 3
    positions: int = 256
    norm_eps: float = 1e-6
    act: str = "gelu_pytorch_tanh"
    merge: int = 2
    projector_hidden: int = 2560
    projector_bias: bool = True
    projector_norm: bool = True
    projector_act: str = "gelu"
    image_token_id: int = 396
    tower: str = TOWER

    def __post_init__(self) -> None:
        side = int(round(self.positions ** 0.5))
        if side * side != self.positions:
            raise ValueError(f"vision_config: num_patches={self.positions} must be a square (the learned position "
                             f"table is side x side)")
        if self.hidden % self.heads:
            raise ValueError(f"vision_config: hidden_size={self.hidden} is not a multiple of "
                             f"num_attention_heads={self.heads}")
        if self.act not in clip.ACTS or self.projector_act not in ("gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"LFM2-VL: vision_config.hidden_act={self.act!r} (one of {clip.ACTS}) or "
                             f"projector_hidden_act={self.projector_act!r} (gelu, gelu_pytorch_tanh) is not supported")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def side(self) -> int:
        """The learned position table's side."""
        return int(round(self.positions ** 0.5))


def init(v: Lfm2VlConfig, text_hidden: int, dtype: torch.dtype, std: float) -> dict:
    """The declarations of the tower (``vision_tower``) and the projector (``multi_modal_projector``)."""
    def w(shape, dims):
        return param(shape, dims, init="normal", scale=std, dtype=dtype)

    def vec(n, dims, how):
        return param(n if isinstance(n, tuple) else (n,), dims, init=how, dtype=dtype)

    return {"vision_tower": siglip2.init(v, w, vec), "multi_modal_projector": projector_params(v, text_hidden, w, vec)}


def projector_params(v, text_hidden: int, w, vec) -> dict:
    """The pixel-unshuffle projector's declarations (LFM2-VL's, InternVL's): ``v.merge``, ``v.projector_hidden``,
    ``v.projector_norm``, ``v.projector_bias``."""
    merged = v.hidden * v.merge ** 2
    proj = {"linear_1": w((merged, v.projector_hidden), "vision_merge mm"),
            "linear_2": w((v.projector_hidden, text_hidden), "mm hidden")}
    if v.projector_norm:
        proj.update(layer_norm=vec(merged, "vision_merge", "ones"), layer_norm_bias=vec(merged, "vision_merge", "zeros"))
    if v.projector_bias:
        proj.update(linear_1_bias=vec(v.projector_hidden, "mm", "zeros"), linear_2_bias=vec(text_hidden, "hidden", "zeros"))
    return proj


def project(proj: dict, x: Named, v: Lfm2VlConfig) -> Named:
    """The projector (batch merged hidden): each ``merge``² consecutive patches' vectors one after the
    other (the pixel unshuffle; InternVL's pixel shuffle is the same order), LayerNorm, linear-GELU-linear."""
    k = v.merge ** 2
    x = ops.split_dim(x, "patch", {"merged": x.size("patch") // k, "merge": k})
    x = ops.merge_dims(ops.transpose(x, "batch", "merged", "merge", "vision"), ("merge", "vision"), "vision_merge")
    if "layer_norm" in proj:
        x = ops.layer_norm(x, proj["layer_norm"], proj["layer_norm_bias"], eps=1e-5)
    h = ops.einsum("batch merged vision_merge, vision_merge mm -> batch merged mm", x, proj["linear_1"])
    if "linear_1_bias" in proj:
        h = h + proj["linear_1_bias"]
    h = ops.gelu(h, approximate="tanh") if v.projector_act == "gelu_pytorch_tanh" else ops.gelu(h)
    h = ops.einsum("batch merged mm, mm hidden -> batch merged hidden", h, proj["linear_2"])
    return h + proj["linear_2_bias"] if "linear_2_bias" in proj else h


def with_images(params: dict, x: Named, images: dict, v: Lfm2VlConfig) -> Named:
    """The token embeddings ``x`` (batch seq hidden) with the projected image features written at the
    image tokens."""
    missing = [k for k in NEEDS if k not in images]
    if missing:
        raise ValueError(f"image inputs: the {v.tower} tower needs {missing} too (data/siglip2_images.py's "
                         f"siglip2_image_batch makes them)")
    n = images["patches"].size("patch")
    if n % (v.merge ** 2):
        raise ValueError(f"image inputs: {n} patches per example is not a multiple of downsample_factor² = "
                         f"{v.merge ** 2} (data/siglip2_images.py pads them so)")
    features = project(params["multi_modal_projector"], siglip2.encode(params["vision_tower"], images, v), v)
    return ops.masked_scatter(x, features.astype(x.data.dtype), images["image_slots"], "merged")


VISION_CONFIG = Lfm2VlConfig
"""The config class of this tower (models/llama.py's ``vision_tower``)."""
