"""Images into a decoder: Pixtral's vision encoder and Mistral 3's multimodal projector, as pure
functions over named arrays (transformers' ``PixtralVisionModel`` and ``Mistral3MultiModalProjector``).

The data path (``data/images.py``) cuts each example's images into patches (``patches``: batch
patch channel patch_y patch_x), in the projector's merge order (each ``merge``² consecutive patches
are one merged token), with each patch's row and column (``patch_positions``: batch patch axis)
and its image (``patch_images``: batch patch; pads a segment of their own). The encoder is the
patch convolution as a contraction over the patch's pixels, an RMSNorm, then layers of
attention inside each image (a block-diagonal mask: ``ops.attention``'s segments), with Pixtral's
2D rotary, and a gated GELU MLP. The projector normalises, merges ``merge``² neighbouring
patches into one vector (a linear of their concatenation) and maps it to the decoder's width by
linear-GELU-linear. The features are written into the token embeddings at the image tokens
(``image_slots``: batch seq, the merged token of each image token, -1 elsewhere) by
``ops.masked_scatter``. The vision dimensions have names of their own (``vision``, ``vheads``,
``vmlp``, ``mm``, ...), replicated unless the rules name them; ``batch`` splits as the text's.
The encoder is one of :data:`VISION_TOWERS` (``VisionConfig.tower``): Pixtral's, or CLIP's
(models/clip.py: LLaVA-1.5), the projector and the scatter the same for each."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models import clip
from functional_pp.parallel.named import Named
from functional_pp.parallel.reshard import named

IMAGE_KEYS = ("patches", "patch_positions", "patch_images", "image_slots")
"""The batch entries that carry images (all or none)."""
EXTRA_KEYS = ("patch_taps", "patch_tap_weights", "mrope_positions", "image_groups")
"""The entries some towers read beside them (models/qwen_vision.py), passed on when the batch has them."""
TOWERS = ("vision_tower", "multi_modal_projector")
"""The parameter subtrees of the image side (beside the text decoder's)."""
PROJECTORS = ("mistral3", "llava")
TOWER = "pixtral"


@dataclass(frozen=True)
class VisionConfig:
    """A Pixtral vision encoder (``vision_config``) and Mistral 3's projector (``spatial_merge_size``,
    ``projector_hidden_act``, ``multimodal_projector_bias``); ``image_token_id`` the token the
    features replace; ``projector_eps`` the projector norm's (the text decoder's ``rms_norm_eps``)."""

    hidden: int = 1024
    layers: int = 24
    heads: int = 16
    mlp: int = 4096
    patch_size: int = 16
    channels: int = 3
    rope_theta: float = 10000.0
    merge: int = 2
    image_token_id: int = 10
    projector_bias: bool = False
    projector_eps: float = 1e-5
    tower: str = "pixtral"
    image_size: int = 1024             # (the largest image side the checkpoint's config names; written on export)
    # the projector: "mistral3" (RMSNorm, the patch merger, linear-GELU-linear: Mistral3MultiModalProjector) or
    # "llava" (linear-GELU-linear: LlavaMultiModalProjector, Pixtral 12B; merge 1)
    projector: str = "mistral3"
    # CLIP's tower (tower="clip", models/clip.py): the layers run (vision_feature_layer), whether the class token's
    # features go to the decoder ("full") or not ("default": vision_feature_select_strategy), its LayerNorms' eps
    # and its MLP's activation (hidden_act)
    feature_layer: int = -1
    select_strategy: str = "full"
    norm_eps: float = 1e-5
    act: str = "gelu"

    def __post_init__(self) -> None:
        if self.tower not in VISION_TOWERS:
            raise ValueError(f"vision tower {self.tower!r}: choose one of {tuple(VISION_TOWERS)}")
        if self.select_strategy not in ("default", "full") or (self.tower == "pixtral"
                                                               and self.select_strategy != "full"):
            raise ValueError(f"vision_feature_select_strategy={self.select_strategy!r} with a {self.tower} tower: "
                             f"'full' (every patch), or 'default' (CLIP's class token dropped) for a clip tower")
        if self.tower == "clip":
            if not -self.layers - 1 <= self.feature_layer <= self.layers or self.act not in clip.ACTS:
                raise ValueError(f"clip tower: vision_feature_layer={self.feature_layer} must index its "
                                 f"{self.layers} layers' hidden states and hidden_act={self.act!r} be one of "
                                 f"{clip.ACTS}")
            if self.image_size % self.patch_size or self.hidden % self.heads:
                raise ValueError(f"clip tower: image_size={self.image_size} is not a multiple of "
                                 f"patch_size={self.patch_size} or hidden_size={self.hidden} not a multiple of "
                                 f"num_attention_heads={self.heads}")
            return
        if self.feature_layer != -1:
            raise ValueError(f"vision_feature_layer={self.feature_layer} is not supported with a Pixtral tower (-1)")
        if self.projector not in PROJECTORS or (self.projector == "llava" and self.merge != 1):
            raise ValueError(f"vision projector {self.projector!r} (merge {self.merge}): choose mistral3, or llava "
                             f"with merge 1 (it merges no patches)")
        if self.hidden % self.heads or (self.hidden // self.heads) % 4:
            raise ValueError(f"vision_config: hidden_size={self.hidden} must be num_attention_heads={self.heads} "
                             f"times a head width divisible by 4 (Pixtral's 2D rotary: a quarter each for rows "
                             f"and columns, twice)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def init(v: VisionConfig, text_hidden: int, dtype: torch.dtype, std: float) -> dict:
    """The declarations of the encoder (``vision_tower``) and the projector (``multi_modal_projector``)."""
    D, H = v.head_dim, v.heads

    def w(shape, dims):
        return param(shape, dims, init="normal", scale=std, dtype=dtype)

    def ones(n, dims):
        return param((n,), dims, init="ones", dtype=dtype)

    def layer():
        return {"attention_norm": ones(v.hidden, "vision"), "ffn_norm": ones(v.hidden, "vision"),
                "attention": {"q_proj": w((v.hidden, H, D), "vision vheads vhead_dim"),
                              "k_proj": w((v.hidden, H, D), "vision vheads vhead_dim"),
                              "v_proj": w((v.hidden, H, D), "vision vheads vhead_dim"),
                              "o_proj": w((H, D, v.hidden), "vheads vhead_dim vision")},
                "feed_forward": {"gate_proj": w((v.hidden, v.mlp), "vision vmlp"),
                                 "up_proj": w((v.hidden, v.mlp), "vision vmlp"),
                                 "down_proj": w((v.mlp, v.hidden), "vmlp vision")}}

    if v.tower == "clip":
        def vec(n, dims, how):
            return param(n if isinstance(n, tuple) else (n,), dims, init=how, dtype=dtype)
        tower = clip.init(v, w, vec)
    else:
        tower = _pixtral_init(v, w, ones, layer)
    projector = {"linear_1": w((v.hidden, text_hidden), "vision mm"), "linear_2": w((text_hidden, text_hidden), "mm hidden")}
    if v.projector == "mistral3":
        projector.update(norm=ones(v.hidden, "vision"),
                         merging_layer=w((v.hidden * v.merge ** 2, v.hidden), "vision_merge vision"))
    if v.projector_bias:
        projector["linear_1_bias"] = param((text_hidden,), "mm", init="zeros", dtype=dtype)
        projector["linear_2_bias"] = param((text_hidden,), "hidden", init="zeros", dtype=dtype)
    return {"vision_tower": tower, "multi_modal_projector": projector}


def _pixtral_init(v: VisionConfig, w, ones, layer) -> dict:
    tower = {"patch_conv": w((v.hidden, v.channels, v.patch_size, v.patch_size), "vision channel patch_y patch_x"),
             "ln_pre": ones(v.hidden, "vision"), "layers": [layer() for _ in range(v.layers)]}
    return tower


def _rotary_tables(pos: Named, v: VisionConfig, dtype: torch.dtype) -> tuple[Named, Named]:
    """cos and sin (batch patch vhead_dim) of Pixtral's axial rotary: the inverse frequencies of the
    head width, the even ones times the patch's row and the odd ones times its column, that pair
    twice (rotate-half order), in float32 as transformers computes them."""
    D = v.head_dim
    inv = 1.0 / (v.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    zeros = torch.zeros(D // 4)
    table = torch.stack([torch.cat([inv[0::2], zeros] * 2), torch.cat([zeros, inv[1::2]] * 2)])
    angles = ops.einsum("batch patch axis, axis vhead_dim -> batch patch vhead_dim", pos.astype(torch.float),
                        named(table.to(pos.data.device), "axis vhead_dim"))
    return ops.cos(angles).astype(dtype), ops.sin(angles).astype(dtype)


def _rotate(x: Named, cos: Named, sin: Named, D: int) -> Named:
    """x * cos + rotate_half(x) * sin over ``vhead_dim``."""
    half = ops.concat([ops.slice_dim(x, "vhead_dim", D // 2, D) * -1.0, ops.slice_dim(x, "vhead_dim", 0, D // 2)],
                      "vhead_dim")
    return x * cos + half * sin


def _layer(p: dict, x: Named, cos: Named, sin: Named, segments: Named, v: VisionConfig) -> Named:
    a = p["attention"]
    h = ops.rms_norm(x, p["attention_norm"], eps=1e-5)
    q = _rotate(ops.einsum("batch patch vision, vision vheads vhead_dim -> batch patch vheads vhead_dim", h,
                           a["q_proj"]), cos, sin, v.head_dim)
    k = _rotate(ops.einsum("batch patch vision, vision vheads vhead_dim -> batch patch vheads vhead_dim", h,
                           a["k_proj"]), cos, sin, v.head_dim)
    val = ops.einsum("batch patch vision, vision vheads vhead_dim -> batch patch vheads vhead_dim", h,
                     a["v_proj"])
    o = ops.attention(q, k, val, causal=False, batch="batch", seq="patch", heads="vheads", kv_heads="vheads",
                      head_dim="vhead_dim", segments=segments)
    x = x + ops.einsum("batch patch vheads vhead_dim, vheads vhead_dim vision -> batch patch vision", o, a["o_proj"])
    f = p["feed_forward"]
    h = ops.rms_norm(x, p["ffn_norm"], eps=1e-5)
    g = ops.gelu(ops.einsum("batch patch vision, vision vmlp -> batch patch vmlp", h, f["gate_proj"]))
    u = ops.einsum("batch patch vision, vision vmlp -> batch patch vmlp", h, f["up_proj"])
    return x + ops.einsum("batch patch vmlp, vmlp vision -> batch patch vision", g * u, f["down_proj"])


def encode(tower: dict, images: dict, v: VisionConfig) -> Named:
    """The vision encoder's hidden states (batch patch vision) of the batch's patches: its
    tower's (:data:`VISION_TOWERS`)."""
    return VISION_TOWERS[v.tower](tower, images, v)


def _pixtral_encode(tower: dict, images: dict, v: VisionConfig) -> Named:
    """Pixtral's last hidden states (batch patch vision) of the batch's patches."""
    patches = images["patches"]
    dtype = tower["ln_pre"].data.dtype
    x = ops.einsum("batch patch channel patch_y patch_x, vision channel patch_y patch_x -> batch patch vision",
                   patches.astype(dtype), tower["patch_conv"])
    x = ops.rms_norm(x, tower["ln_pre"], eps=1e-5)
    cos, sin = _rotary_tables(images["patch_positions"], v, x.data.dtype)
    for p in tower["layers"]:
        x = _layer(p, x, cos, sin, images["patch_images"], v)
    return x


VISION_TOWERS = {"pixtral": _pixtral_encode, "clip": clip.encode}
"""The vision towers by ``VisionConfig.tower``: each a function (tower params, image entries, config)
-> hidden states (batch patch vision)."""


def project(proj: dict, x: Named, v: VisionConfig) -> Named:
    """The projector to the decoder's width (batch merged hidden): Mistral 3's RMSNorm and patch merger
    (each ``merge``² consecutive patches, in the order of ``torch.nn.functional.unfold``'s
    channels-first columns, through ``merging_layer``), then linear-GELU-linear (LLaVA's alone)."""
    if v.projector == "llava":
        x = ops.rename(x, patch="merged")
    else:
        k = v.merge ** 2
        x = ops.rms_norm(x, proj["norm"], eps=v.projector_eps)
        x = ops.split_dim(x, "patch", {"merged": x.size("patch") // k, "merge": k})
        x = ops.merge_dims(ops.transpose(x, "batch", "merged", "vision", "merge"), ("vision", "merge"), "vision_merge")
        x = ops.einsum("batch merged vision_merge, vision_merge vision -> batch merged vision", x,
                       proj["merging_layer"])
    h = ops.einsum("batch merged vision, vision mm -> batch merged mm", x, proj["linear_1"])
    if "linear_1_bias" in proj:
        h = h + proj["linear_1_bias"]
    h = ops.einsum("batch merged mm, mm hidden -> batch merged hidden", ops.gelu(h), proj["linear_2"])
    return h + proj["linear_2_bias"] if "linear_2_bias" in proj else h


def image_inputs(batch: dict) -> dict | None:
    """The batch's image entries (:data:`IMAGE_KEYS`), or None for a text batch; a partial set is refused."""
    have = [k for k in IMAGE_KEYS if k in batch]
    if not have:
        return None
    if len(have) != len(IMAGE_KEYS):
        raise ValueError(f"image inputs: the batch has {have} but not {[k for k in IMAGE_KEYS if k not in have]}; "
                         f"give all of {IMAGE_KEYS} (data/images.py's image_batch makes them)")
    return {k: batch[k] for k in IMAGE_KEYS + EXTRA_KEYS if k in batch}


def with_images(params: dict, x: Named, images: dict, v: VisionConfig) -> Named:
    """The token embeddings ``x`` (batch seq hidden) with the projected image features written at
    the image tokens."""
    n = images["patches"].size("patch")
    if n % (v.merge ** 2):
        raise ValueError(f"image inputs: {n} patches per example is not a multiple of spatial_merge_size² = "
                         f"{v.merge ** 2} (data/images.py pads them so)")
    features = project(params["multi_modal_projector"], encode(params["vision_tower"], images, v), v)
    return ops.masked_scatter(x, features.astype(x.data.dtype), images["image_slots"], "merged")


VISION_CONFIG = VisionConfig
"""The config class of this tower (models/llama.py's ``vision_tower``)."""
