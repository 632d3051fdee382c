"""Llama 4's image tiles (transformers' ``Llama4ImageProcessor``, whose torchvision backend is
optional: the same steps on torch tensors): the canvas of whole ``size`` tiles (at most
``max_patches``) that needs the least resizing without distortion, the image resized onto it
(bilinear, antialiased, its aspect ratio kept) and padded right and bottom with zeros, rescaled and
normalised in bfloat16 as the original implementation, cut into tiles row by row; for more than
one tile a global tile (the whole image resized to one tile) after them. The text of an image
(``Llama4Processor``): ``<|image_start|>``, each tile's ``<|patch|>`` tokens (one per merged patch)
row by row with ``<|tile_x_separator|>`` between tiles and ``<|tile_y_separator|>`` after each row,
then ``<|image|>`` and the global tile's (the only tile's) patches, ``<|image_end|>``."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch


def resolutions(max_patches: int, size: int) -> list[tuple[int, int]]:
    """The canvases (height, width) of at most ``max_patches`` tiles, in Llama 4's order."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for n in range(max_patches, 0, -1):
        for h in sorted({d for i in range(1, int(n ** 0.5) + 1) if n % i == 0 for d in (i, n // i)}):
            by_ratio.setdefault(h / (n // h), []).append((h, n // h))
    return [(h * size, w * size) for pairs in by_ratio.values() for h, w in pairs]


def best_fit(height: int, width: int, canvases: list[tuple[int, int]], to_max: bool = False) -> tuple[int, int]:
    """The canvas needing the smallest upscale (the largest with ``to_max``), else the least
    downscale, without distortion; of equal scales the smallest area."""
    c = torch.tensor(canvases)
    scales = torch.minimum(c[:, 1] / width, c[:, 0] / height)
    up = scales[scales >= 1]
    chosen = (up.max() if to_max else up.min()) if len(up) else scales[scales < 1].max()
    fits = c[scales == chosen]
    h, w = fits[torch.argmin(fits[:, 0] * fits[:, 1])].tolist()
    return int(h), int(w)


def _fitted(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The largest size of that aspect ratio within ``target`` (get_max_res_without_distortion)."""
    th, tw = target
    if tw / width < th / height:
        return max(min(math.floor(height * (tw / width)), th), 1), max(tw, 1)
    return max(th, 1), max(min(math.floor(width * (th / height)), tw), 1)


def _resize(img: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """A uint8 (C, H, W) image resized bilinearly with antialiasing (torchvision's tensor resize)."""
    return torch.nn.functional.interpolate(img[None], size=(h, w), mode="bilinear", antialias=True,
                                           align_corners=False)[0]


@dataclass
class Llama4Tiler:
    """``Llama4ImageProcessor``'s settings (its ``preprocessor_config.json``) and its tiling."""

    size: int = 336
    max_patches: int = 16
    resize_to_max_canvas: bool = False
    rescale: float = 1 / 255
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_file(cls, path: Path) -> "Llama4Tiler":
        import json
        conf = json.loads(path.read_text())
        size = conf.get("size") or {"height": 336, "width": 336}
        if size.get("height") != size.get("width") or conf.get("do_resize") is False:
            raise ValueError(f"{path}: Llama 4's tiles are square and always resized (size {size}, do_resize "
                             f"{conf.get('do_resize')})")
        if int(conf.get("resample", 2)) != 2 or conf.get("do_normalize") is False or conf.get("do_rescale") is False:
            raise ValueError(f"{path}: resample={conf.get('resample')}, do_rescale / do_normalize off are not "
                             f"supported (Llama 4's: bilinear, rescaled and normalised)")
        return cls(int(size["height"]), int(conf.get("max_patches", 16)), bool(conf.get("resize_to_max_canvas")),
                   float(conf.get("rescale_factor", 1 / 255)), tuple(conf.get("image_mean", (0.5,) * 3)),
                   tuple(conf.get("image_std", (0.5,) * 3)))

    def _normalised(self, img: torch.Tensor) -> torch.Tensor:
        x = img.to(torch.bfloat16) * self.rescale
        mean = torch.tensor(self.mean, dtype=torch.bfloat16)[:, None, None]
        std = torch.tensor(self.std, dtype=torch.bfloat16)[:, None, None]
        return (x - mean) / std

    def tiles(self, picture) -> tuple[torch.Tensor, tuple[int, int]]:
        """``(tiles (n, C, size, size) in bfloat16, (tile rows, tile columns))`` of a PIL image (or a
        uint8 C x H x W tensor)."""
        import numpy as np
        img = picture if isinstance(picture, torch.Tensor) else \
            torch.from_numpy(np.array(picture.convert("RGB"))).permute(2, 0, 1).contiguous()
        h, w = img.shape[-2:]
        S = self.size
        canvas = best_fit(h, w, resolutions(self.max_patches, S), self.resize_to_max_canvas)
        limit = canvas if self.resize_to_max_canvas else (min(max(h, S), canvas[0]), min(max(w, S), canvas[1]))
        nh, nw = _fitted(h, w, limit)
        fitted = torch.nn.functional.pad(_resize(img, nh, nw), (0, canvas[1] - nw, 0, canvas[0] - nh))
        x = self._normalised(fitted)
        rows, cols = canvas[0] // S, canvas[1] // S
        out = x.reshape(x.shape[0], rows, S, cols, S).permute(1, 3, 0, 2, 4).reshape(rows * cols, x.shape[0], S, S)
        if rows * cols > 1:
            out = torch.cat([out, self._normalised(_resize(img, S, S))[None]])
        return out, (rows, cols)


def image_text(ratio: tuple[int, int], per_tile: int) -> str:
    """Llama4Processor's tokens of an image of ``ratio`` tiles, ``per_tile`` patch tokens each."""
    rows, cols = ratio
    text = "<|image_start|>"
    if rows * cols > 1:
        for _ in range(rows):
            text += "<|tile_x_separator|>".join(["<|patch|>" * per_tile] * cols) + "<|tile_y_separator|>"
    return text + "<|image|>" + "<|patch|>" * per_tile + "<|image_end|>"
