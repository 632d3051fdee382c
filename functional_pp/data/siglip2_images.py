"""Images as batch entries of a SigLIP2 NaFlex tower (models/siglip2.py, LFM2-VL), from what its image
processor makes (``Lfm2VlImageProcessor``: ``pixel_values``, each tile or image one row of
``max_num_patches`` patches of ``patch x patch x channels`` values, row by row, then padding, and
``spatial_shapes``, each one's height and width in patches).

Entries (global tensors; ``P`` patches per example, padded to one count for the batch): those of
data/images.py (``patches`` B, P, C, patch, patch: in merge order, each ``merge x merge`` block of
an image one image token; ``patch_positions``; ``patch_images``: each tile its own image;
``image_slots``) plus ``patch_taps`` and ``patch_tap_weights`` (B, P, K: the rows of the learned
``side x side`` position table each patch reads and their weights: transformers'
``Siglip2VisionEmbeddings.resize_positional_embeddings``, an antialiased bilinear resize of the
table to the image's grid, its non-zero weights in float32; K the most any image of the stream needs)."""
from __future__ import annotations

from typing import Sequence

import torch

from functional_pp.data.qwen_images import _grid_positions


def _axis_weights(size: int, side: int) -> torch.Tensor:
    """(size, side) weights of an antialiased bilinear resize of ``side`` entries to ``size``, in float32
    (transformers' formula: a triangle of half-width max(scale, 1) around each output's source centre)."""
    scale = side / size
    support = max(scale, 1.0)
    center = (torch.arange(size, dtype=torch.float32) + 0.5) * scale - 0.5
    source = torch.arange(side, dtype=torch.float32)
    w = (1 - (source - center[:, None]).abs() / support).clamp(min=0)
    return w / w.sum(-1, keepdim=True)


def position_weights(h: int, w: int, side: int) -> torch.Tensor:
    """(h * w, side * side) weights of each patch (row by row) over the position table's rows."""
    rows, cols = _axis_weights(h, side), _axis_weights(w, side)
    return (rows[:, None, :, None] * cols[None, :, None, :]).reshape(h * w, side * side)


def tap_count(shapes: torch.Tensor, side: int) -> int:
    """The most non-zero position weights any patch of images of ``shapes`` (n x 2, in patches) reads."""
    return max([1] + [int((position_weights(int(h), int(w), side) > 0).sum(-1).max()) for h, w in shapes.tolist()])


def siglip2_image_batch(ids: torch.Tensor, pixel_values: Sequence[torch.Tensor | None],
                        shapes: Sequence[torch.Tensor | None], *, merge: int, image_token_id: int, side: int,
                        channels: int, patch: int, patches: int | None = None, taps: int | None = None) -> dict:
    """The entries for token rows ``ids`` (B, S) and each row's images (``pixel_values[b]``: n_b x
    max_num_patches x (patch*patch*C); ``shapes[b]``: n_b x 2 ``spatial_shapes``; None: no image).
    ``patches`` / ``taps`` pad every row to that many patches / position taps (default: the batch's
    most). A row whose image tokens do not number its images' merged tokens is refused, naming the
    row and both counts; an image whose grid is not a multiple of ``merge`` each way too."""
    k = merge ** 2
    for b, s in enumerate(shapes):
        for j, (h, w) in enumerate(s.tolist() if s is not None else []):
            if h % merge or w % merge or not h or not w:
                raise ValueError(f"images: row {b}'s image {j} is {h} x {w} patches, not a positive multiple of "
                                 f"downsample_factor={merge} each way (the model's own processor resizes so)")
    counts = [0 if s is None else int(s.prod(-1).sum()) for s in shapes]
    P = max([k] + counts) if patches is None else patches
    if P < max([k] + counts) or P % k:
        raise ValueError(f"images: patches={patches} must be a multiple of {k} and at least {max([k] + counts)}")
    need = max(tap_count(s, side) for s in [torch.zeros(0, 2), *[s for s in shapes if s is not None]])
    K = need if taps is None else taps
    if K < need:
        raise ValueError(f"images: taps={taps} is fewer than the {need} position weights a patch of these images reads")
    B, S = ids.shape
    dtype = next((p.dtype for p in pixel_values if p is not None), torch.float32)
    out = {"patches": torch.zeros(B, P, channels, patch, patch, dtype=dtype),
           "patch_positions": torch.zeros(B, P, 2, dtype=torch.long),
           "patch_images": torch.zeros(B, P, dtype=torch.long),
           "image_slots": torch.full((B, S), -1, dtype=torch.long),
           "patch_taps": torch.zeros(B, P, K, dtype=torch.long),
           "patch_tap_weights": torch.zeros(B, P, K, dtype=torch.float32)}
    for b in range(B):
        s, n = shapes[b], counts[b]
        n_tokens = int((ids[b] == image_token_id).sum())
        if n_tokens != n // k:
            raise ValueError(f"images: row {b} holds {n_tokens} image tokens (id {image_token_id}) but its "
                             f"{0 if s is None else len(s)} images make {n // k} merged patches; the processor "
                             f"expands each image into its tokens, so a row cut short (sequence_len) or a template "
                             f"that drops them does this: raise sequence_len or check the chat template")
        at = (ids[b] == image_token_id).nonzero().flatten()
        out["image_slots"][b, at] = torch.arange(len(at))
        out["patch_images"][b, n:] = 0 if s is None else len(s)     # the pads: a segment of their own
        start = 0
        for j, (h, w) in enumerate(s.tolist() if s is not None else []):
            pos = _grid_positions(h, w, merge)
            flat = pos[:, 0] * w + pos[:, 1]                        # (the processor's row-by-row order)
            px = pixel_values[b][j, flat].reshape(-1, patch, patch, channels).permute(0, 3, 1, 2)
            m = h * w
            out["patches"][b, start:start + m] = px
            out["patch_positions"][b, start:start + m] = pos
            out["patch_images"][b, start:start + m] = j
            weights = position_weights(h, w, side)[flat]
            top = weights.topk(K, -1)
            out["patch_taps"][b, start:start + m] = top.indices
            out["patch_tap_weights"][b, start:start + m] = top.values
            start += m
    return out
