"""SigLIP2's NaFlex vision tower (transformers' ``Siglip2VisionModel``, LFM2-VL's) as a pure function
over named arrays: one entry of the vision towers (models/lfm2_vl.py's ``Lfm2VlConfig.tower``).

Each patch comes as its processor flattened it (``patches``: batch patch channel patch_y patch_x,
the patch linear's input reordered); the tower is the patch linear with its bias, plus the learned
``side x side`` position table resampled to the patch's image grid (``patch_taps`` /
``patch_tap_weights``: the table rows each patch reads and their weights, antialiased bilinear as
transformers computes them; data/siglip2_images.py), then CLIP's encoder layers (models/clip.py:
LayerNorm, attention with biases inside each image, a tanh-GELU MLP) and ``post_layernorm``. The
attention-pooling head (``vision_use_head``) is not built: LFM2-VL reads the hidden states."""
from __future__ import annotations

from functional_pp import ops
from functional_pp.models import clip
from functional_pp.parallel.named import Named


def init(v, w, vec) -> dict:
    """The tower's declarations; ``w(shape, dims)`` a random weight, ``vec(n, dims, init)`` a vector."""
    return {"embeddings": {"patch_embedding": w((v.patch_size, v.patch_size, v.channels, v.hidden),
                                                "patch_y patch_x channel vision"),
                           "patch_embedding_bias": vec(v.hidden, "vision", "zeros"),
                           "position_embedding": w((v.positions, v.hidden), "vpositions vision")},
            "encoder": {"layers": [clip.layer_params(v, w, vec) for _ in range(v.layers)]},
            "post_layernorm": vec(v.hidden, "vision", "ones"), "post_layernorm_bias": vec(v.hidden, "vision", "zeros")}


def encode(tower: dict, images: dict, v) -> Named:
    """The tower's last hidden states (batch patch vision), after ``post_layernorm``."""
    e = tower["embeddings"]
    dtype = e["patch_embedding"].data.dtype
    x = ops.einsum("batch patch channel patch_y patch_x, patch_y patch_x channel vision -> batch patch vision",
                   images["patches"].astype(dtype), e["patch_embedding"]) + e["patch_embedding_bias"]
    rows = ops.embed(e["position_embedding"], images["patch_taps"], vocab="vpositions")     # batch patch tap vision
    x = x + ops.einsum("batch patch tap vision, batch patch tap -> batch patch vision", rows,
                       images["patch_tap_weights"].astype(dtype))
    for p in tower["encoder"]["layers"]:
        x = clip.encoder_layer(p, x, images["patch_images"], v)
    return ops.layer_norm(x, tower["post_layernorm"], tower["post_layernorm_bias"], eps=v.norm_eps)
