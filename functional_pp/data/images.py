"""Images as batch entries of a vision-language model (models/pixtral.py): each example's images,
as its processor made them (``pixel_values`` and ``image_sizes``: transformers' image processor
does the resizing and normalising), cut into patches in the projector's merge order, with their
positions, their image and the merged token each image token of the text takes.

Entries (global tensors; ``P`` patches per example, padded to one count for the batch):
``patches`` (B, P, channels, patch, patch), ``patch_positions`` (B, P, 2: row and column in its
image), ``patch_images`` (B, P: the image's index in its example; pads one past the last); a CLIP
tower's images each led by a class token's slot (``class_token``: zero pixels, position (0, -1)),
Llama 4's tiles each followed by one (``"trailing"``: every example's patches whole tiles, pads too),
``image_slots`` (B, S: the merged token the k-th image token takes, k; -1 at other tokens); with
``groups`` ``image_groups`` (B, S: the run of consecutive image tokens each token is in, numbered
from 0 in its row, -1 elsewhere: transformers' ``get_block_sequence_ids_for_mask``, the tokens of
one image attending to each other under Gemma 4 unified's bidirectional mask)."""
from __future__ import annotations

from typing import Sequence

import torch

IMAGE_DIMS = {"patches": "batch patch channel patch_y patch_x", "patch_positions": "batch patch axis",
              "patch_images": "batch patch", "image_slots": "batch seq", "image_groups": "batch seq",
              # the entries Qwen's tower reads beside them (data/qwen_images.py)
              "patch_taps": "batch patch tap", "patch_tap_weights": "batch patch tap",
              "mrope_positions": "batch seq mrope"}
"""The dimension names of each entry (``fpp.named(entry, IMAGE_DIMS[key])``)."""


def _patches(pixels: torch.Tensor, size: Sequence[int], patch: int, merge: int, where: str):
    """One image's patches (n, C, patch, patch) in merge order and their (row, column)."""
    h, w = int(size[0]), int(size[1])
    gh, gw = h // patch, w // patch
    if gh % merge or gw % merge or not gh or not gw:
        raise ValueError(f"{where}: an image of {h} x {w} pixels is {gh} x {gw} patches of {patch}, not a positive "
                         f"multiple of spatial_merge_size={merge} each way; use the model's own processor "
                         f"(processor_type: AutoProcessor), whose image processor resizes to multiples of "
                         f"{patch * merge}")
    c = pixels.shape[0]
    grid = pixels[:, :gh * patch, :gw * patch].reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    # (rows of merged tokens, their columns, row in the merge, column in the merge, C, py, px)
    grid = grid.permute(1, 4, 2, 5, 0, 3, 6).reshape(-1, c, patch, patch)
    r = torch.arange(gh).reshape(gh // merge, merge, 1, 1).expand(gh // merge, merge, gw // merge, merge)
    col = torch.arange(gw).reshape(1, 1, gw // merge, merge).expand(gh // merge, merge, gw // merge, merge)
    pos = torch.stack([r.permute(0, 2, 1, 3).reshape(-1), col.permute(0, 2, 1, 3).reshape(-1)], -1)
    return grid, pos


def _with_class_slot(grid: torch.Tensor, pos: torch.Tensor, size: Sequence[int], image_size: int, where: str,
                     trailing: bool = False):
    """A CLIP image's patches led by its class token's slot (zero pixels, position (0, -1)); a Llama 4
    tile's followed by it (``trailing``)."""
    if [int(size[0]), int(size[1])] != [image_size, image_size]:
        tower, what = ("Llama 4", "tiles of ") if trailing else ("CLIP", "")
        raise ValueError(f"{where}: an image of {int(size[0])} x {int(size[1])} pixels; a {tower} tower takes "
                         f"{what}{image_size} x {image_size} (its position table; image_size); use the model's own "
                         f"processor (processor_type: AutoProcessor), whose image processor resizes and "
                         f"{'tiles' if trailing else 'crops'} to it")
    slot, at = grid.new_zeros((1, *grid.shape[1:])), torch.tensor([[0, -1]])
    if trailing:
        return torch.cat([grid, slot]), torch.cat([pos, at])
    return torch.cat([slot, grid]), torch.cat([at, pos])


def image_batch(ids: torch.Tensor, pixel_values: Sequence[torch.Tensor | None],
                image_sizes: Sequence[torch.Tensor | None], *, patch: int, merge: int, image_token_id: int,
                patches: int | None = None, class_token: str | None = None,
                image_size: int | None = None, groups: bool = False) -> dict[str, torch.Tensor]:
    """The image entries for token rows ``ids`` (B, S) and each row's images (``pixel_values[b]``:
    n_b x C x H x W, padded; ``image_sizes[b]``: n_b x 2, each image's height and width; None: no
    image). ``patches`` pads every row to that many patches (default: the batch's most, at least
    one merged token). ``class_token`` (a CLIP tower, images of ``image_size`` pixels each way):
    each image led by its class token's slot, whose features the image tokens take first (``"kept"``:
    ``vision_feature_select_strategy: full``, merge 1) or skip (``"dropped"``: ``default``; with a
    ``merge`` above 1, InternVL, every class slot after all the images' patches, so that the merged
    tokens are the images' ``merge x merge`` blocks); ``"trailing"`` (Llama 4's tiles of ``image_size``,
    any ``merge``): each tile followed by it, the tower drops it before merging, and the patches are
    padded to whole tiles. A row whose image tokens do not number its images' merged tokens is
    refused, naming the row and both counts."""
    trailing = class_token == "trailing"
    if class_token not in (None, "kept", "dropped", "trailing") or (class_token and not image_size) or \
            (class_token == "kept" and merge != 1):
        raise ValueError(f"images: class_token={class_token!r} must be None, 'kept' (merge 1, got {merge}), "
                         f"'dropped' or 'trailing', the latter three with the tower's image_size (got {image_size})")
    last = class_token == "dropped" and merge > 1
    rows = []
    for b in range(ids.shape[0]):
        px, sizes = pixel_values[b], image_sizes[b]
        grids, poss, owners, slots = [], [], [], []
        for j in range(0 if px is None else len(px)):
            g, p = _patches(px[j], sizes[j], patch, merge, f"row {b}, image {j}")
            if class_token:
                g, p = _with_class_slot(g, p, sizes[j], image_size, f"row {b}, image {j}", trailing)
            if last:                                 # (the class slot after every image's patches)
                slots.append((g[:1], p[:1], j))
                g, p = g[1:], p[1:]
            grids.append(g)
            poss.append(p)
            owners.append(torch.full((len(g),), j, dtype=torch.long))
        n_tokens, n_images = int((ids[b] == image_token_id).sum()), len(grids)
        n_merged = ((sum(len(g) for g in grids) - n_images) // merge ** 2 if trailing else
                    sum(len(g) for g in grids) // merge ** 2 - (n_images if class_token == "dropped" and not last
                                                                 else 0))
        for g, p, j in slots:
            grids.append(g)
            poss.append(p)
            owners.append(torch.full((1,), j, dtype=torch.long))
        if n_tokens != n_merged:
            raise ValueError(f"images: row {b} holds {n_tokens} image tokens (id {image_token_id}) but its "
                             f"{n_images} images make {n_merged} merged patches; the processor expands each "
                             f"image into its tokens, so a row cut short (sequence_len) or a template that drops "
                             f"them does this: raise sequence_len or check the chat template")
        rows.append((grids, poss, owners))
    k = (image_size // patch) ** 2 + 1 if trailing else merge ** 2       # (the unit the patches pad to)
    width = -(-max([k] + [sum(len(g) for g in grids) for grids, _, _ in rows]) // k) * k   # (whole units)
    P = width if patches is None else patches
    if P < width or P % k:
        raise ValueError(f"images: patches={patches} must be a multiple of {k} and at least {width}")
    c = next((g[0].shape[0] for grids, _, _ in rows for g in grids), 3)
    dtype = next((px.dtype for px in pixel_values if px is not None), torch.float32)
    out = {"patches": torch.zeros(len(rows), P, c, patch, patch, dtype=dtype),
           "patch_positions": torch.zeros(len(rows), P, 2, dtype=torch.long),
           "patch_images": torch.zeros(len(rows), P, dtype=torch.long),
           "image_slots": torch.full(ids.shape, -1, dtype=torch.long)}
    for b, (grids, poss, owners) in enumerate(rows):
        n = sum(len(g) for g in grids)
        if n:
            out["patches"][b, :n] = torch.cat(grids)
            out["patch_positions"][b, :n] = torch.cat(poss)
            out["patch_images"][b, :n] = torch.cat(owners)
        out["patch_images"][b, n:] = len(grids)               # the pads: a segment of their own
        at = (ids[b] == image_token_id).nonzero().flatten()
        slots = torch.arange(len(at))                          # (the merged tokens in order)
        if class_token == "dropped" and not last:              # (the patches in order, the class slots skipped)
            slots = (out["patch_positions"][b, :n, 1] >= 0).nonzero().flatten()
        out["image_slots"][b, at] = slots
    if groups:
        out["image_groups"] = image_groups(ids == image_token_id)
    return out


def image_groups(is_image: torch.Tensor) -> torch.Tensor:
    """(B, S) the run of consecutive image tokens (``is_image``) each token is in, from 0 in its row;
    -1 at other tokens (transformers' ``get_block_sequence_ids_for_mask``)."""
    prev = torch.zeros_like(is_image)
    prev[:, 1:] = is_image[:, :-1]
    runs = torch.cumsum((is_image & ~prev).long(), 1) - 1
    return torch.where(is_image, runs, torch.full_like(runs, -1))
