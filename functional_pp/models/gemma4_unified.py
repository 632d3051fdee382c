"""Images into Gemma 4 unified (``gemma4_unified``: Gemma 4 12B) without a vision encoder:
transformers' ``Gemma4UnifiedVisionEmbedder`` as a pure function over named arrays, one more entry of
``Config.vision`` (models/llama.py's ``vision_tower``) beside models/gemma4_vision.py.

Early fusion: each soft token is one model patch of ``pool`` x ``pool`` patches of ``patch_size``
pixels, its ``(pool * patch_size)² * 3`` pixels in (row, column, channel) order (the unified image
processor's ``patches_merge``), through a LayerNorm, a linear with a bias and a LayerNorm (``patch_ln1``,
``patch_dense``, ``patch_ln2``), plus a learned embedding of its column and one of its row
(``pos_embedding``: ``positions x 2 x embed``, axis 0 the column), a LayerNorm (``pos_norm``), then the
multimodal embedder (a weightless RMSNorm in float32, the linear to the decoder's width). The data path
is Gemma 4's (data/images.py's entries in pooling order: ``pool``² consecutive patches one soft token);
the pixels are the processor's, in [0, 1]. The decoder's attention lets an image's tokens see each
other (``Config.image_groups_attend``, the batch's ``image_groups``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.parallel.named import Named

TOWER = "gemma4_unified"
TOWERS = (TOWER,)
"""The tower names this module builds."""


@dataclass(frozen=True)
class UnifiedVisionConfig:
    """Gemma 4 unified's ``vision_config`` (``pooling_kernel_size`` is ``pool``, ``mm_embed_dim``
    ``embed``, ``mm_posemb_size`` ``positions``) and the image token and begin / end of image tokens."""

    patch_size: int = 16
    pool: int = 3
    embed: int = 3840
    positions: int = 1120
    channels: int = 3
    norm_eps: float = 1e-6          # (the multimodal embedder's RMSNorm: rms_norm_eps)
    ln_eps: float = 1e-5            # (the LayerNorms: torch's default, as transformers builds them)
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    tower: str = TOWER

    def __post_init__(self) -> None:
        if self.pool < 1 or self.patch_size < 1:
            raise ValueError(f"vision_config: pooling_kernel_size={self.pool} and patch_size={self.patch_size} must "
                             f"be at least 1")

    @property
    def merge(self) -> int:
        """Patches per soft token each way (the pooling kernel): data/images.py's ``merge``."""
        return self.pool


def init(v: UnifiedVisionConfig, text_hidden: int, dtype: torch.dtype, std: float) -> dict:
    """The declarations of the embedder (under ``multi_modal_projector``: frozen with ``freeze_mm_modules``)."""
    pixels = (v.patch_size * v.pool) ** 2 * v.channels

    def ln(n, dims, name):
        return {name: param((n,), dims, init="ones", dtype=dtype),
                f"{name}_bias": param((n,), dims, init="zeros", dtype=dtype)}
    return {"multi_modal_projector": {
        **ln(pixels, "vpixel", "patch_ln1"),
        "patch_dense": param((pixels, v.embed), "vpixel vision", init="normal", scale=std, dtype=dtype),
        "patch_dense_bias": param((v.embed,), "vision", init="zeros", dtype=dtype),
        **ln(v.embed, "vision", "patch_ln2"),
        "pos_embedding": param((v.positions, 2, v.embed), "vpositions axis vision", init="normal", scale=std,
                               dtype=dtype),
        **ln(v.embed, "vision", "pos_norm"),
        "embedding_projection": param((v.embed, text_hidden), "vision hidden", init="normal", scale=std,
                                      dtype=dtype)}}


def _layer_norm(p: dict, name: str, x: Named, v: UnifiedVisionConfig) -> Named:
    return ops.layer_norm(x, p[name], p[f"{name}_bias"], eps=v.ln_eps)


def embed(p: dict, images: dict, v: UnifiedVisionConfig) -> Named:
    """The soft tokens (batch merged hidden) of the batch's patches (data/images.py's entries)."""
    dtype = p["patch_dense"].data.dtype
    k = v.pool
    n = images["patches"].size("patch") // (k * k)
    px = ops.split_dim(images["patches"].astype(dtype), "patch", {"merged": n, "merge_y": k, "merge_x": k})
    px = ops.transpose(px, "batch", "merged", "merge_y", "patch_y", "merge_x", "patch_x", "channel")
    px = ops.merge_dims(px, ("merge_y", "patch_y", "merge_x", "patch_x", "channel"), "vpixel")
    h = _layer_norm(p, "patch_ln1", px, v)
    h = ops.einsum("batch merged vpixel, vpixel vision -> batch merged vision", h, p["patch_dense"])
    h = _layer_norm(p, "patch_ln2", h + p["patch_dense_bias"], v)
    first = ops.take(ops.split_dim(images["patch_positions"], "patch", {"merged": n, "merge": k * k}), "merge", 0)
    row, col = ops.unbind(first.map(lambda t: torch.div(t, k, rounding_mode="floor")), "axis")
    by_col, by_row = ops.unbind(p["pos_embedding"], "axis")
    h = h + (ops.embed(by_col, col, vocab="vpositions") + ops.embed(by_row, row, vocab="vpositions"))
    h = _layer_norm(p, "pos_norm", h, v)
    wide = torch.promote_types(h.data.dtype, torch.float32)      # (transformers' RMSNorm: in float32 at least)
    normed = ops.rms_norm(h.astype(wide), dim="vision", eps=v.norm_eps).astype(h.data.dtype)
    return ops.einsum("batch merged vision, vision hidden -> batch merged hidden", normed, p["embedding_projection"])


def with_images(params: dict, x: Named, images: dict, v: UnifiedVisionConfig) -> Named:
    """The token embeddings ``x`` (batch seq hidden) with the soft tokens written at the image tokens."""
    n = images["patches"].size("patch")
    if n % (v.pool ** 2):
        raise ValueError(f"image inputs: {n} patches per example is not a multiple of pooling_kernel_size² = "
                         f"{v.pool ** 2} (data/images.py pads them so)")
    features = embed(params["multi_modal_projector"], images, v)
    return ops.masked_scatter(x, features.astype(x.data.dtype), images["image_slots"], "merged")


VISION_CONFIG = UnifiedVisionConfig
"""The config class of this tower (models/llama.py's ``vision_tower``)."""
