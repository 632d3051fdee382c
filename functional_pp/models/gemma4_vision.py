"""Images into a Gemma 4 decoder: Gemma 4's vision encoder (transformers' ``Gemma4VisionModel``) and
its multimodal embedder (``Gemma4MultimodalEmbedder``, the projector) as pure functions over named
arrays: one more tower of ``Config.vision`` (models/llama.py's ``vision_tower``), the same entries
and mechanism as models/pixtral.py.

The data path (data/images.py's ``image_batch`` with ``merge`` the pooling kernel) gives each
example's patches in pooling order (each ``pool``² consecutive patches one soft token, the soft
tokens of an image row by row), their row and column (``patch_positions``) and their image
(``patch_images``). The tower: the pixels scaled to [-1, 1] (``2 * (x - 0.5)``: Gemma 4's
processor does not normalise) through a linear of the patch's pixels (``input_proj``), plus a
learned embedding of the patch's column and one of its row (``position_embedding_table``), then
layers of Gemma's sandwich norms (RMSNorms scaling by ``w``) around attention inside each image
(a block-diagonal mask; q and k RMSNorms, a weightless v norm, no softmax scale, a 2D rotary: the
first half of each head rotated by the column, the second by the row, rotate-half within each
half) and a gated GELU(tanh) MLP. The pooler averages each ``pool`` x ``pool`` block of patches
and scales by ``sqrt(hidden)`` (in at least float32, as transformers); the embedder normalises
(a weightless RMSNorm) and maps to the decoder's width. The features are written at the image
tokens by ``ops.masked_scatter``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.parallel.named import Named
from functional_pp.parallel.reshard import named

TOWER = "gemma4"
TOWERS = (TOWER,)
"""The tower names this module builds."""

ACTIVATIONS = {"gelu_pytorch_tanh": lambda h: ops.gelu(h, approximate="tanh"), "gelu": ops.gelu}
"""The MLP activations (``hidden_activation``) the tower computes."""


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """Gemma 4's ``vision_config`` (``pooling_kernel_size`` is ``pool``, ``position_embedding_size``
    ``positions``) and the multimodal config's image token and begin / end of image tokens."""

    hidden: int = 768
    layers: int = 16
    heads: int = 12
    head_dim: int = 64
    mlp: int = 3072
    patch_size: int = 16
    channels: int = 3
    pool: int = 3
    positions: int = 10 * 1024
    rope_theta: float = 100.0
    norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    tower: str = TOWER

    def __post_init__(self) -> None:
        if self.head_dim % 4:
            raise ValueError(f"vision_config: head_dim={self.head_dim} must be divisible by 4 (the 2D rotary: a "
                             f"half each for columns and rows, each rotated half against half)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config: hidden_activation={self.hidden_act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        if self.pool < 1:
            raise ValueError(f"vision_config: pooling_kernel_size={self.pool} must be at least 1")

    @property
    def merge(self) -> int:
        """Patches per soft token each way (the pooling kernel): data/images.py's ``merge``."""
        return self.pool


def init(v: Gemma4VisionConfig, text_hidden: int, dtype: torch.dtype, std: float) -> dict:
    """The declarations of the encoder (``vision_tower``) and the embedder (``multi_modal_projector``)."""
    H, D = v.heads, v.head_dim

    def w(shape, dims):
        return param(shape, dims, init="normal", scale=std, dtype=dtype)

    def ones(n, dims):
        return param((n,), dims, init="ones", dtype=dtype)

    def layer():
        return {**{n: ones(v.hidden, "vision") for n in ("input_layernorm", "post_attention_layernorm",
                                                        "pre_feedforward_layernorm", "post_feedforward_layernorm")},
                "self_attn": {**{f"{x}_proj": w((v.hidden, H, D), "vision vheads vhead_dim") for x in "qkv"},
                              "o_proj": w((H, D, v.hidden), "vheads vhead_dim vision"),
                              "q_norm": ones(D, "vhead_dim"), "k_norm": ones(D, "vhead_dim")},
                "mlp": {"gate_proj": w((v.hidden, v.mlp), "vision vmlp"),
                        "up_proj": w((v.hidden, v.mlp), "vision vmlp"),
                        "down_proj": w((v.mlp, v.hidden), "vmlp vision")}}

    pixels = v.patch_size * v.patch_size * v.channels
    tower = {"input_proj": w((pixels, v.hidden), "vpixel vision"),
             "position_table": w((2, v.positions, v.hidden), "axis vpositions vision"),
             "encoder": [layer() for _ in range(v.layers)]}
    return {"vision_tower": tower, "multi_modal_projector": {"embedding_projection": w((v.hidden, text_hidden),
                                                                                         "vision hidden")}}


def _rotary_tables(pos: Named, v: Gemma4VisionConfig, dtype: torch.dtype) -> tuple[Named, Named]:
    """cos and sin (batch patch vhead_dim): the inverse frequencies of half the head width times the
    patch's column over the first half (twice: rotate-half order), times its row over the second,
    in float32 as transformers computes them."""
    half = v.head_dim // 2
    inv = 1.0 / (v.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    zeros = torch.zeros(half // 2)
    table = torch.stack([torch.cat([zeros, zeros, inv, inv]), torch.cat([inv, inv, zeros, zeros])])   # row, column
    angles = ops.einsum("batch patch axis, axis vhead_dim -> batch patch vhead_dim", pos.astype(torch.float),
                        named(table.to(pos.data.device), "axis vhead_dim"))
    return ops.cos(angles).astype(dtype), ops.sin(angles).astype(dtype)


def _rotate(x: Named, cos: Named, sin: Named, D: int) -> Named:
    """x * cos + rotate_half(x) * sin, rotate-half within each half of ``vhead_dim``."""
    q = D // 4
    parts = [ops.slice_dim(x, "vhead_dim", i * q, (i + 1) * q) for i in range(4)]
    half = ops.concat([parts[1] * -1.0, parts[0], parts[3] * -1.0, parts[2]], "vhead_dim")
    return x * cos + half * sin


def _layer(p: dict, x: Named, cos: Named, sin: Named, segments: Named, v: Gemma4VisionConfig) -> Named:
    a, eps = p["self_attn"], v.norm_eps
    h = ops.rms_norm(x, p["input_layernorm"], eps=eps)

    def proj(role):
        return ops.einsum("batch patch vision, vision vheads vhead_dim -> batch patch vheads vhead_dim", h,
                          a[f"{role}_proj"])
    q = _rotate(ops.rms_norm(proj("q"), a["q_norm"], eps=eps), cos, sin, v.head_dim)
    k = _rotate(ops.rms_norm(proj("k"), a["k_norm"], eps=eps), cos, sin, v.head_dim)
    val = ops.rms_norm(proj("v"), dim="vhead_dim", eps=eps)
    o = ops.attention(q, k, val, causal=False, scale=1.0, batch="batch", seq="patch", heads="vheads",
                      kv_heads="vheads", head_dim="vhead_dim", segments=segments)
    o = ops.einsum("batch patch vheads vhead_dim, vheads vhead_dim vision -> batch patch vision", o, a["o_proj"])
    x = x + ops.rms_norm(o, p["post_attention_layernorm"], eps=eps)
    f = p["mlp"]
    h = ops.rms_norm(x, p["pre_feedforward_layernorm"], eps=eps)
    g = ACTIVATIONS[v.hidden_act](ops.einsum("batch patch vision, vision vmlp -> batch patch vmlp", h, f["gate_proj"]))
    u = ops.einsum("batch patch vision, vision vmlp -> batch patch vmlp", h, f["up_proj"])
    m = ops.einsum("batch patch vmlp, vmlp vision -> batch patch vision", g * u, f["down_proj"])
    return x + ops.rms_norm(m, p["post_feedforward_layernorm"], eps=eps)


def encode(tower: dict, images: dict, v: Gemma4VisionConfig) -> Named:
    """The encoder's last hidden states (batch patch vision) of the batch's patches."""
    dtype = tower["input_proj"].data.dtype
    px = ops.transpose(images["patches"].astype(dtype), "batch", "patch", "patch_y", "patch_x", "channel")
    px = ops.merge_dims(px, ("patch_y", "patch_x", "channel"), "vpixel") * 2.0 - 1.0
    x = ops.einsum("batch patch vpixel, vpixel vision -> batch patch vision", px, tower["input_proj"])
    row, col = ops.unbind(images["patch_positions"], "axis")
    by_col, by_row = ops.unbind(tower["position_table"], "axis")
    x = x + ops.embed(by_col, col, vocab="vpositions") + ops.embed(by_row, row, vocab="vpositions")
    cos, sin = _rotary_tables(images["patch_positions"], v, x.data.dtype)
    for p in tower["encoder"]:
        x = _layer(p, x, cos, sin, images["patch_images"], v)
    return x


def project(proj: dict, x: Named, v: Gemma4VisionConfig) -> Named:
    """The pooler and the embedder (batch merged hidden): each ``pool``² consecutive patches averaged,
    times ``sqrt(hidden)`` (at least float32, as transformers), a weightless RMSNorm, then the linear
    to the decoder's width."""
    k = v.pool ** 2
    work = x.astype(torch.promote_types(x.data.dtype, torch.float32))
    work = ops.split_dim(work, "patch", {"merged": x.size("patch") // k, "merge": k})
    pooled = ops.sum(work, "merge") * (v.hidden ** 0.5 / k)
    normed = ops.rms_norm(pooled, dim="vision", eps=v.norm_eps).astype(x.data.dtype)
    return ops.einsum("batch merged vision, vision hidden -> batch merged hidden", normed, proj["embedding_projection"])


def with_images(params: dict, x: Named, images: dict, v: Gemma4VisionConfig) -> Named:
    """The token embeddings ``x`` (batch seq hidden) with the soft tokens written at the image tokens."""
    n = images["patches"].size("patch")
    if n % (v.pool ** 2):
        raise ValueError(f"image inputs: {n} patches per example is not a multiple of pooling_kernel_size² = "
                         f"{v.pool ** 2} (data/images.py pads them so)")
    features = project(params["multi_modal_projector"], encode(params["vision_tower"], images, v), v)
    return ops.masked_scatter(x, features.astype(x.data.dtype), images["image_slots"], "merged")


VISION_CONFIG = Gemma4VisionConfig
"""The config class of this tower (models/llama.py's ``vision_tower``)."""
