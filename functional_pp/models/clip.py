"""CLIP's vision tower (transformers' ``CLIPVisionModel``, LLaVA-1.5's) as a pure function over
named arrays: one entry of the vision towers of models/pixtral.py (``VisionConfig.tower="clip"``).

The patches come as data/images.py cuts them, each image led by a slot for its class token
(zero pixels, position (0, -1)); a patch at (row, column) takes the learned position
``1 + row * grid + column`` (``grid = image_size / patch_size``), the class token position 0.
The encoder is the patch convolution (no bias) as a contraction over the patch's pixels, the
class embedding added at the class slots, the position embeddings, ``pre_layrnorm``, then
layers of LayerNorm, attention with biases inside each image (``ops.attention``'s segments) and
a quick-GELU (or GELU) MLP. LLaVA reads the hidden states after ``feature_layer`` layers
(``vision_feature_layer``: -2, the second to last): only those layers are declared; the layers
after it and ``post_layernorm`` (no gradient in transformers either) are skipped on read and
absent from an export (transformers then initialises them; LLaVA never runs them)."""
from __future__ import annotations

import torch

from functional_pp import ops
from functional_pp.parallel.named import Named

ACTS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")
"""The MLP activations of ``hidden_act`` the encoder layer computes (SigLIP's: the tanh GELU)."""


def _act(x: Named, name: str) -> Named:
    if name == "quick_gelu":
        return x.map(lambda t: t * torch.sigmoid(1.702 * t))
    return ops.gelu(x, approximate="tanh") if name == "gelu_pytorch_tanh" else ops.gelu(x)


def grid(v) -> int:
    """Patches per image side (``image_size / patch_size``): the position table's grid."""
    return v.image_size // v.patch_size


def init(v, w, vec) -> dict:
    """The tower's declarations; ``w(shape, dims)`` a random weight, ``vec(n, dims, init)`` a vector."""
    return {"patch_embedding": w((v.hidden, v.channels, v.patch_size, v.patch_size), "vision channel patch_y patch_x"),
            "class_embedding": w((v.hidden,), "vision"),
            "position_embedding": w((grid(v) ** 2 + 1, v.hidden), "vpos vision"),
            "pre_layrnorm": vec(v.hidden, "vision", "ones"), "pre_layrnorm_bias": vec(v.hidden, "vision", "zeros"),
            "layers": [layer_params(v, w, vec) for _ in range(used_layers(v))]}


def layer_params(v, w, vec) -> dict:
    """One encoder layer's declarations (CLIP's, SigLIP's: the same layer; models/siglip2.py)."""
    H, D = v.heads, v.head_dim
    return {"layer_norm1": vec(v.hidden, "vision", "ones"), "layer_norm1_bias": vec(v.hidden, "vision", "zeros"),
            "layer_norm2": vec(v.hidden, "vision", "ones"), "layer_norm2_bias": vec(v.hidden, "vision", "zeros"),
            "self_attn": {**{f"{x}_proj": w((v.hidden, H, D), "vision vheads vhead_dim") for x in "qkv"},
                          **{f"{x}_bias": vec((H, D), "vheads vhead_dim", "zeros") for x in "qkv"},
                          "out_proj": w((H, D, v.hidden), "vheads vhead_dim vision"),
                          "out_bias": vec(v.hidden, "vision", "zeros")},
            "mlp": {"fc1": w((v.hidden, v.mlp), "vision vmlp"), "fc1_bias": vec(v.mlp, "vmlp", "zeros"),
                    "fc2": w((v.mlp, v.hidden), "vmlp vision"), "fc2_bias": vec(v.hidden, "vision", "zeros")}}


def encoder_layer(p: dict, x: Named, segments: Named, v) -> Named:
    """One encoder layer (batch patch vision): LayerNorm, attention inside each image (``segments``;
    q / k / v biases where declared), LayerNorm, the MLP of ``v.act``; CLIP's and SigLIP's, and
    InternViT's with its layer scales (``lambda_1``, ``lambda_2``: each branch scaled per channel)."""
    a = p["self_attn"]
    h = ops.layer_norm(x, p["layer_norm1"], p["layer_norm1_bias"], eps=v.norm_eps)

    def proj(n):
        y = ops.einsum("batch patch vision, vision vheads vhead_dim -> batch patch vheads vhead_dim", h, a[f"{n}_proj"])
        return y + a[f"{n}_bias"] if f"{n}_bias" in a else y
    o = ops.attention(proj("q"), proj("k"), proj("v"), causal=False, batch="batch", seq="patch", heads="vheads",
                      kv_heads="vheads", head_dim="vhead_dim", segments=segments)
    o = ops.einsum("batch patch vheads vhead_dim, vheads vhead_dim vision -> batch patch vision", o,
                   a["out_proj"]) + a["out_bias"]
    x = x + (o * p["lambda_1"] if "lambda_1" in p else o)
    m = p["mlp"]
    h = ops.layer_norm(x, p["layer_norm2"], p["layer_norm2_bias"], eps=v.norm_eps)
    h = _act(ops.einsum("batch patch vision, vision vmlp -> batch patch vmlp", h, m["fc1"]) + m["fc1_bias"], v.act)
    h = ops.einsum("batch patch vmlp, vmlp vision -> batch patch vision", h, m["fc2"]) + m["fc2_bias"]
    return x + (h * p["lambda_2"] if "lambda_2" in p else h)


def used_layers(v) -> int:
    """How many layers run: those up to ``feature_layer`` (-1 all, -2 all but the last, k >= 0 k)."""
    return v.feature_layer if v.feature_layer >= 0 else v.layers + 1 + v.feature_layer


def encode(tower: dict, images: dict, v) -> Named:
    """The hidden states (batch patch vision) after :func:`used_layers` layers, class slots included."""
    dtype = tower["pre_layrnorm"].data.dtype
    x = ops.einsum("batch patch channel patch_y patch_x, vision channel patch_y patch_x -> batch patch vision",
                   images["patches"].astype(dtype), tower["patch_embedding"])
    row, col = ops.unbind(images["patch_positions"], "axis")
    is_class = col.map(lambda t: (t < 0).to(dtype))
    x = x + is_class * tower["class_embedding"]
    x = x + ops.embed(tower["position_embedding"], row * grid(v) + col + 1)
    x = ops.layer_norm(x, tower["pre_layrnorm"], tower["pre_layrnorm_bias"], eps=v.norm_eps)
    for p in tower["layers"]:
        x = encoder_layer(p, x, images["patch_images"], v)
    return x
