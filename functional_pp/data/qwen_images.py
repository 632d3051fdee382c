"""Images as batch entries of a Qwen vision-language model (models/qwen_vision.py), from what Qwen's
image processor makes (``Qwen2VLImageProcessor``: ``pixel_values``, one row per patch of
``channels x temporal_patch_size x patch x patch`` values in merge order, and ``image_grid_thw``,
each image's temporal, height and width in patches).

Entries (global tensors; ``P`` patches per example, padded to one count for the batch): those of
data/images.py (``patches`` B, P, C*T, patch, patch; ``patch_positions``; ``patch_images``;
``image_slots``) plus ``patch_taps`` and ``patch_tap_weights`` (B, P, 4: the rows of the learned
side x side position table each patch reads and their bilinear weights, align_corners, as
transformers' ``get_vision_interpolation_indices_and_weights``; B, P, 16 bicubic for GLM-4V's tower,
:data:`RESAMPLING`) and ``mrope_positions`` (B, S, 3:
each token's temporal, height and width position, transformers' ``get_rope_index``: text tokens
count on, all three equal; an image's tokens sit at the count it starts at plus their merged row
and column, and the count goes on from its start plus the larger of its merged rows and columns)."""
from __future__ import annotations

import functools

from typing import Sequence

import torch



def _grid_positions(gh: int, gw: int, merge: int) -> torch.Tensor:
    """(row, column) of an image's gh x gw patches in merge order (each merge x merge block in turn)."""
    r = torch.arange(gh).reshape(gh // merge, merge, 1, 1).expand(gh // merge, merge, gw // merge, merge)
    c = torch.arange(gw).reshape(1, 1, gw // merge, merge).expand(gh // merge, merge, gw // merge, merge)
    return torch.stack([r.permute(0, 2, 1, 3).reshape(-1), c.permute(0, 2, 1, 3).reshape(-1)], -1)


def _bilinear_taps(index: torch.Tensor, size: int, side: int, align_corners: bool = True) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """Bilinear taps (floor, floor + 1, clamped) into ``side`` rows for ``index`` of ``size``, align_corners
    (Qwen3-VL's ``get_vision_interpolation_indices_and_weights``) or at half-pixel centres (PaddleOCR-VL's),
    and their weights, in float32."""
    index = index.to(torch.float32)
    src = index * (side - 1) / max(size - 1, 1) if align_corners else (index + 0.5) * side / size - 0.5
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    return taps, (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)


def _bicubic_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bicubic taps (floor - 1 to floor + 2, clamped: border padding) into ``side`` rows for the
    centres of ``index`` of ``size`` (align_corners False) and their weights (A = -0.75), in float32:
    ``F.grid_sample(mode="bicubic", padding_mode="border")`` along one axis (GLM-4V's)."""
    src = (index.to(torch.float32) + 0.5) * side / size - 0.5
    floor = torch.floor(src)
    t = (src - floor)[:, None]
    a = -0.75
    near = lambda d: ((a + 2) * d - (a + 3)) * d * d + 1                 # noqa: E731  |d| <= 1
    far = lambda d: ((a * d - 5 * a) * d + 8 * a) * d - 4 * a             # noqa: E731  1 < |d| < 2
    weights = torch.cat([far(t + 1), near(t), near(1 - t), far(2 - t)], 1)
    return (floor.long()[:, None] + torch.arange(-1, 3)).clamp(0, side - 1), weights


RESAMPLING = {"bilinear": _bilinear_taps, "bilinear_half": functools.partial(_bilinear_taps, align_corners=False),
              "bicubic": _bicubic_taps}
"""How a tower resamples its learned position table to an image's grid (its config's ``resample``):
the taps along one axis; a patch reads their products along both."""


def mrope_positions(ids: torch.Tensor, grids: torch.Tensor | None, image_token_id: int, merge: int) -> torch.Tensor:
    """(S, 3) multimodal rotary positions of one row of tokens whose images have ``grids`` (n x 3)."""
    out = torch.zeros(len(ids), 3, dtype=torch.long)
    pos, i, j = 0, 0, 0
    while i < len(ids):
        if int(ids[i]) != image_token_id:
            out[i] = pos
            pos, i = pos + 1, i + 1
            continue
        if grids is None or j >= len(grids):
            raise ValueError(f"images: image token at position {i} past the row's {0 if grids is None else len(grids)} "
                             f"images")
        t, h, w = (int(x) for x in grids[j])
        h, w = h // merge, w // merge
        n = t * h * w
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        block = torch.stack([tt, hh, ww], -1).reshape(-1, 3) + pos
        out[i:i + n] = block[:len(out) - i]
        pos, i, j = pos + max(h, w), i + n, j + 1
    return out


def qwen_image_batch(ids: torch.Tensor, pixel_values: Sequence[torch.Tensor | None],
                     grids: Sequence[torch.Tensor | None], *, merge: int, image_token_id: int, side: int,
                     channels: int, temporal_patch: int, patch: int, patches: int | None = None,
                     resample: str = "bilinear", raster: bool = False) -> dict:
    """The entries for token rows ``ids`` (B, S) and each row's images (``pixel_values[b]``: its
    patches' rows, n_b x (C*T*patch*patch); ``grids[b]``: n_b x 3 ``image_grid_thw``; None: no
    image). ``patches`` pads every row to that many patches (default: the batch's most);
    ``resample`` the position table's resampling (:data:`RESAMPLING`: 4 taps, 16 bicubic); ``raster``:
    the rows come in raster order (PaddleOCR-VL's image processor), put here into merge order. A row
    whose image tokens do not number its images' merged tokens is refused, naming the row and both
    counts."""
    if resample not in RESAMPLING:
        raise ValueError(f"images: resample={resample!r} is not one of {sorted(RESAMPLING)}")
    taps_of, n_taps = RESAMPLING[resample], (4 if resample == "bicubic" else 2) ** 2
    k = merge ** 2
    counts = [0 if g is None else int(g.prod(-1).sum()) for g in grids]
    P = max([k] + counts) if patches is None else patches
    if P < max([k] + counts) or P % k:
        raise ValueError(f"images: patches={patches} must be a multiple of {k} and at least {max([k] + counts)}")
    B, S = ids.shape
    dtype = next((p.dtype for p in pixel_values if p is not None), torch.float32)
    out = {"patches": torch.zeros(B, P, channels * temporal_patch, patch, patch, dtype=dtype),
           "patch_positions": torch.zeros(B, P, 2, dtype=torch.long),
           "patch_images": torch.zeros(B, P, dtype=torch.long),
           "image_slots": torch.full((B, S), -1, dtype=torch.long),
           "mrope_positions": torch.zeros(B, S, 3, dtype=torch.long)}
    if side:                  # (a learned position table to resample: Qwen3-VL / Qwen3.5; Qwen2-VL has none)
        out.update(patch_taps=torch.zeros(B, P, n_taps, dtype=torch.long),
                   patch_tap_weights=torch.zeros(B, P, n_taps, dtype=torch.float32))
    for b in range(B):
        g, n = grids[b], counts[b]
        n_tokens = int((ids[b] == image_token_id).sum())
        if n_tokens != n // k:
            raise ValueError(f"images: row {b} holds {n_tokens} image tokens (id {image_token_id}) but its "
                             f"{0 if g is None else len(g)} images make {n // k} merged patches; the processor "
                             f"expands each image into its tokens, so a row cut short (sequence_len) or a template "
                             f"that drops them does this: raise sequence_len or check the chat template")
        out["mrope_positions"][b] = mrope_positions(ids[b], g, image_token_id, merge)
        at = (ids[b] == image_token_id).nonzero().flatten()
        out["image_slots"][b, at] = torch.arange(len(at))
        out["patch_images"][b, n:] = 0 if g is None else len(g)     # the pads: a segment of their own
        if not n:
            continue
        rows = pixel_values[b].reshape(n, channels * temporal_patch, patch, patch)
        start = 0
        for j, (t, h, w) in enumerate(tuple(int(x) for x in row) for row in g):
            m = t * h * w
            pos = _grid_positions(h, w, merge).repeat(t, 1)
            order = torch.arange(m) if not raster else \
                (torch.arange(t).repeat_interleave(h * w) * h * w + (pos[:, 0] * w + pos[:, 1]))
            out["patches"][b, start:start + m] = rows[start + order]
            out["patch_positions"][b, start:start + m] = pos
            out["patch_images"][b, start:start + m] = j
            if side:
                (hr, hw_), (cr, cw) = taps_of(pos[:, 0], h, side), taps_of(pos[:, 1], w, side)
                out["patch_taps"][b, start:start + m] = (hr[:, :, None] * side + cr[:, None, :]).reshape(m, n_taps)
                out["patch_tap_weights"][b, start:start + m] = (hw_[:, :, None] * cw[:, None, :]).reshape(m, n_taps)
            start += m
    return out
