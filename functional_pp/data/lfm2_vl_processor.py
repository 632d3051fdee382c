"""LFM2-VL's image processor (transformers' ``Lfm2VlImageProcessor``, which needs torchvision) on PIL,
and its processor's image tokens (``Lfm2VlProcessor``).

An image is resized to a multiple of ``encoder_patch_size x downsample_factor`` pixels each way
within ``min_image_tokens`` .. ``max_image_tokens`` tokens (``smart_resize``); one too large
(beyond ``max_pixels_tolerance`` times that) is split into a grid of ``tile_size`` tiles, the grid
of ``min_tiles`` .. ``max_tiles`` closest to its aspect ratio, each tile then the single-image-sized
thumbnail (``use_thumbnail``). Each tile / image is rescaled, normalised and cut into patches of
``patch x patch x channels`` values row by row (``pixel_values``, padded to ``max_num_patches``,
with its ``spatial_shapes`` in patches). The resize is PIL's bilinear (antialiased) where
transformers' uses torchvision's (the same filter; a pixel may differ by one level of 255).

The text: ``<|image_start|>``, per tile ``<|img_row_R_col_C|>`` and its tokens, ``<|img_thumbnail|>``
and the thumbnail's, ``<|image_end|>``; one ``<image>`` per ``downsample_factor x downsample_factor``
patches."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
START, END, THUMBNAIL = "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"


def _closest_ratio(aspect: float, ratios: list[tuple[int, int]], width: int, height: int, tile: int) -> tuple[int, int]:
    best, best_diff = (1, 1), float("inf")
    for r in ratios:
        diff = abs(aspect - r[0] / r[1])
        if diff < best_diff:
            best, best_diff = r, diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * r[0] * r[1]:
            best = r
    return best


@dataclass
class Lfm2VlImages:
    """The image processor's settings (``preprocessor_config.json``'s keys) and its processing."""

    downsample_factor: int = 2
    do_image_splitting: bool = True
    min_tiles: int = 2
    max_tiles: int = 10
    use_thumbnail: bool = True
    min_image_tokens: int = 64
    max_image_tokens: int = 256
    encoder_patch_size: int = 16
    tile_size: int = 512
    max_pixels_tolerance: float = 2.0
    rescale_factor: float = 1 / 255
    image_mean: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    use_image_special_tokens: bool = True

    @classmethod
    def from_dir(cls, root: str | Path) -> "Lfm2VlImages":
        """The settings of ``preprocessor_config.json`` (and ``processor_config.json``'s
        ``use_image_special_tokens``) in the model directory ``root``."""
        root = Path(root)
        conf = json.loads((root / "preprocessor_config.json").read_text())
        proc = root / "processor_config.json"
        if proc.is_file():
            special = json.loads(proc.read_text()).get("use_image_special_tokens", True)
            conf.setdefault("use_image_special_tokens", special)
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in conf.items() if k in names})

    @property
    def patch(self) -> int:
        return self.encoder_patch_size

    @property
    def max_num_patches(self) -> int:
        tiles = (self.tile_size // self.patch) ** 2 if self.do_image_splitting else 0
        return max(self.max_image_tokens * self.downsample_factor ** 2, tiles)

    def _tiles_range(self) -> tuple[int, int]:
        return (self.min_tiles, self.max_tiles) if self.do_image_splitting else (1, 1)

    def smart_resize(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the single image (or the thumbnail)."""
        f = self.patch * self.downsample_factor
        lo, hi = (t * self.patch ** 2 * self.downsample_factor ** 2 for t in (self.min_image_tokens,
                                                                            self.max_image_tokens))
        h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
        if h * w > hi:
            beta = math.sqrt(height * width / hi)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < lo:
            beta = math.sqrt(lo / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def layout(self, height: int, width: int) -> tuple[int, int, int, int]:
        """``(rows, cols, height, width)``: the tile grid (1 x 1: not split) and the resized size."""
        f = self.patch * self.downsample_factor
        h, w = max(self.patch, round(height / f) * f), max(self.patch, round(width / f) * f)
        most = self.max_image_tokens * self.patch ** 2 * self.downsample_factor ** 2
        large = h * w > most * self.max_pixels_tolerance
        new_h, new_w = self.smart_resize(height, width)
        lo, hi = self._tiles_range()
        if not (large and not lo == hi == 1):
            return 1, 1, new_h, new_w
        ratios = sorted({(a, b) for n in range(lo, hi + 1) for a in range(1, n + 1) for b in range(1, n + 1)
                         if lo <= a * b <= hi}, key=lambda r: r[0] * r[1])
        cols, rows = _closest_ratio(width / height, ratios, width, height, self.tile_size)
        return rows, cols, new_h, new_w

    def _pixels(self, img) -> torch.Tensor:
        """(C, H, W) rescaled and normalised pixels of a PIL image."""
        import numpy as np
        x = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32).copy()).permute(2, 0, 1)
        mean, std = torch.tensor(self.image_mean)[:, None, None], torch.tensor(self.image_std)[:, None, None]
        return (x * self.rescale_factor - mean) / std

    def _patches(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        c, h, w = x.shape
        p = self.patch
        grid = x.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0).reshape((h // p) * (w // p), p * p * c)
        out = torch.zeros(self.max_num_patches, p * p * c)
        out[:len(grid)] = grid
        return out, [h // p, w // p]

    def __call__(self, images: list) -> dict:
        """``pixel_values`` (n, max_num_patches, patch*patch*C), ``spatial_shapes`` (n, 2),
        ``pixel_attention_mask`` and per image ``image_rows``, ``image_cols``, ``image_sizes``."""
        from PIL import Image
        tiles, shapes, rows_of, cols_of, sizes = [], [], [], [], []
        for img in images:
            img = img.convert("RGB")
            rows, cols, h, w = self.layout(img.height, img.width)
            crops = [img.resize((w, h), Image.BILINEAR)]
            if rows * cols > 1:
                t = self.tile_size
                big = img.resize((t * cols, t * rows), Image.BILINEAR)
                crops = [big.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)]
                if self.use_thumbnail:
                    crops.append(img.resize((w, h), Image.BILINEAR))
            for crop in crops:
                px, shape = self._patches(self._pixels(crop))
                tiles.append(px)
                shapes.append(shape)
            rows_of.append(rows)
            cols_of.append(cols)
            sizes.append([h, w])
        shapes_t = torch.tensor(shapes)
        mask = (torch.arange(self.max_num_patches) < shapes_t.prod(-1)[:, None]).to(torch.int32)
        return {"pixel_values": torch.stack(tiles), "spatial_shapes": shapes_t, "pixel_attention_mask": mask,
                "image_rows": rows_of, "image_cols": cols_of, "image_sizes": sizes}

    def image_tokens(self, rows: int, cols: int, size: list[int]) -> str:
        """The text an image of that layout expands into (``Lfm2VlProcessor``'s)."""
        f, p = self.downsample_factor, self.patch
        per_tile = math.ceil((self.tile_size // p) / f) ** 2
        whole = math.ceil((size[0] // p) / f) * math.ceil((size[1] // p) / f)
        special = self.use_image_special_tokens
        parts = [START] if special else []
        if rows > 1 or cols > 1:
            for r in range(rows):
                for c in range(cols):
                    parts += ([f"<|img_row_{r + 1}_col_{c + 1}|>"] if special else []) + [IMAGE_TOKEN * per_tile]
            if self.use_thumbnail:
                parts += ([THUMBNAIL] if special else []) + [IMAGE_TOKEN * whole]
        else:
            parts.append(IMAGE_TOKEN * whole)
        return "".join(parts + ([END] if special else []))
