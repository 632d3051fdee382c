"""Chat records with images (``processor_type``: Axolotl's multimodal chat data), encoded by the
model's own processor (transformers' ``AutoProcessor``: its chat template renders the
conversation, it expands each image into its image tokens and its image processor resizes and
normalises the pixels); the images of each row kept beside the token stream (:class:`RowImages`)
for the loader to cut into patches (data/images.py).

As Axolotl's ``MultiModalChatDataCollator`` and processing strategies (``processing_strategies.py``):
a record's ``messages`` (or ``conversations``: ``from`` / ``value``) with string contents made
content lists; its ``images`` (or ``image``) column's first image placed at the first bare
``{"type": "image"}`` entry, else appended to the first user turn; the labels every token but the
padding and the image tokens (``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]``; LLaVA's ``<image>``:
Axolotl's Mistral 3 strategy and its base strategy for ``chat_template: llava``, which mask no
role); with ``chat_template: pixtral`` that template renders the rows
and only the assistant's replies train (its Pixtral strategy). Qwen's processors (``Qwen2VLProcessor``,
``Qwen3VLProcessor``: Qwen2-VL, Qwen3.5) expand each ``<|image_pad|>`` into one per merged patch
(``image_grid_thw``'s product over ``merge_size``²) and their image processor (``Qwen2VLImageProcessor``)
gives the patches' rows (data/qwen_images.py); the labels mask the padding and ``<|image_pad|>``
(Axolotl's Qwen2-VL strategy). GLM-4V's (``Glm4vProcessor``, ``Glm46VProcessor``) lay images out as
Qwen's, ``<|image|>`` their image token; the labels mask it, the padding and the image and video
markers (:data:`GLM_MARKERS`: Axolotl's GLM-4V strategy). Gemma 4's (``Gemma4Processor``) writes
each image as its begin token, one image token per soft token (``num_soft_tokens_per_image``: a ``pooling_kernel_size``² block of
patches each) and its end token; its image processor (``Gemma4ImageProcessor``, resizing within
``max_soft_tokens``) gives the patches as rows of pixels, put back into each image's pixels here
for data/images.py to cut in pooling order; the labels mask the padding and the three image tokens.
``Llama4Processor`` tiles each image (data/llama4_images.py: its image processor's steps on torch
tensors; transformers' class needs torchvision) and writes each as ``<|image_start|>``, the tiles'
``<|patch|>`` tokens with their separators and ``<|image_end|>``; the labels mask the padding and
``<|image|>`` (Axolotl's base strategy, ``chat_template: llama4``: its processor's image token).
LFM2-VL's (``Lfm2VlProcessor``: data/lfm2_vl_processor.py, its image processor on PIL) expands each
``<image>`` into its tiles' and thumbnail's tokens, one per ``downsample_factor``² patches, between
its markers; the labels mask the padding and ``<image>`` (Axolotl's base strategy). InternVL's
(``InternVLProcessor``) expands each ``<IMG_CONTEXT>`` into ``<img>``, ``image_seq_length`` of it per
tile of ``GotOcr2ImageProcessor`` (its PIL backend), ``</img>``; the labels mask the padding and
``<IMG_CONTEXT>``. Gemma 4 unified's (``Gemma4UnifiedProcessor``: Gemma 4 12B) lays the text out as
Gemma 4's; its image processor (``Gemma4UnifiedImageProcessor``, torchvision only) gives each soft
token's pooled block as one row of pixels: where torchvision is missing Gemma 4's PIL image processor
is read from the same ``preprocessor_config.json`` (the same resize and rescale; the model merges the
patches itself). Audio in a record (an ``audio`` column or content entry) is refused by name."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from functional_pp.data.images import image_batch
from functional_pp.data.llama4_images import Llama4Tiler, image_text
from functional_pp.data.qwen_images import qwen_image_batch
from functional_pp.data.siglip2_images import siglip2_image_batch, tap_count

QWEN_PROCESSORS = {"Qwen2VLProcessor": "<|image_pad|>", "Qwen3VLProcessor": "<|image_pad|>",
                   "Glm4vProcessor": "<|image|>", "Glm46VProcessor": "<|image|>",
                   "PaddleOCRVLProcessor": "<|IMAGE_PLACEHOLDER|>"}
"""The processor classes of Qwen's layout (one image token per merged patch; PaddleOCR-VL's image
processor gives its patches in raster order) and their image token where ``processor_config.json``
does not name it."""
GLM_MARKERS = ("<|begin_of_image|>", "<|end_of_image|>", "<|video|>", "<|begin_of_video|>", "<|end_of_video|>")
"""The tokens GLM-4V's labels mask beside its image token (those its tokenizer has)."""
GEMMA4_PROCESSORS = ("Gemma4Processor", "Gemma4UnifiedProcessor")
"""The processor classes of Gemma 4's layout (begin token, a token per soft token, end token)."""
LFM2_VL_PROCESSOR = "Lfm2VlProcessor"
INTERNVL_PROCESSOR = "InternVLProcessor"
PROCESSORS = ("PixtralProcessor", "LlavaProcessor", *QWEN_PROCESSORS, *GEMMA4_PROCESSORS, "Llama4Processor",
              LFM2_VL_PROCESSOR, INTERNVL_PROCESSOR)
"""The processor classes whose layout :class:`ImageChatProcessor` reproduces."""


@dataclass
class ImageChatProcessor:
    """The parts of an image chat processor: the tokenizer with its chat template, the image
    processor (transformers' own class: it resizes and normalises) and how an image of ``h`` x
    ``w`` pixels becomes tokens (``layout``): ``PixtralProcessor``'s (Mistral 3, Pixtral: ``w / patch``
    image tokens and a break per row of ``patch`` pixels, the last break the end token),
    ``LlavaProcessor``'s (``llava``, LLaVA-1.5: ``(h / patch) * (w / patch) + extra`` image tokens,
    ``extra`` its ``num_additional_image_tokens`` less one when the class token's features are
    dropped, ``vision_feature_select_strategy: default``), Qwen's (``qwen``: one image token per
    merged patch), Gemma 4's (``gemma4``: a begin token, one image token per pooled block, an end token),
    Llama 4's (``llama4``: tiles, ``<|patch|>`` per merged patch of each, :func:`image_text`;
    ``extra`` then the merged patches per tile), LFM2-VL's (``lfm2_vl``: tiles, a thumbnail and their
    markers; data/lfm2_vl_processor.py) or InternVL's (``internvl``: ``GotOcr2ImageProcessor``'s tiles of
    ``image_size`` pixels, ``extra`` image tokens each, between the ``bounds``)."""

    tokenizer: Any
    image_processor: Any
    chat_template: str
    patch: int
    image_token: str = "[IMG]"
    image_break_token: str | None = "[IMG_BREAK]"
    image_end_token: str | None = "[IMG_END]"
    # Axolotl's PixtralProcessingStrategy (chat_template: pixtral): only the assistant's replies trained, each
    # from after the [/INST] that opens it through the EOS that ends it (None: every token, its Mistral 3 strategy)
    reply_after: str | None = None
    # "pixtral" (rows of [IMG] and breaks), "llava" (one image_token per patch, + extra), "qwen" (one
    # image_token per merged patch; Qwen2VLImageProcessor's patches and image_grid_thw) or "llama4" (tiles;
    # patch_token the features' token); merge: Qwen's merge_size
    layout: str = "pixtral"
    patch_token: str | None = None
    merge: int = 1
    extra: int = 0
    image_begin_token: str | None = None      # (Gemma 4's: before each image's tokens, as its end token after)
    bounds: tuple[str, str] = ("", "")       # (InternVL: <img> and </img> around an image's tokens)
    # more tokens the labels mask where the tokenizer has them (GLM-4V: its image and video markers)
    also_masked: tuple[str, ...] = ()

    def process(self, pictures: list) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """``(pixel_values, image_sizes or image_grid_thw or spatial_shapes, each image's tokens)`` of ``pictures``."""
        if self.layout == "gemma4":
            out = self.image_processor(pictures, return_tensors="pt")
            side = self.patch if _merges(self.image_processor) else self.patch // self.merge   # (the rows' patch side)
            px, sizes = _gemma4_pixels(out["pixel_values"], out["image_position_ids"], side)
            return px, sizes, [self.image_begin_token + self.image_token * int(n) + self.image_end_token
                               for n in out["num_soft_tokens_per_image"]]
        if self.layout == "internvl":                # (each picture one or more tiles of image_size pixels)
            out = self.image_processor(pictures, crop_to_patches=True, return_tensors="pt")
            px, counts = out["pixel_values"], [int(n) for n in out["num_patches"]]
            return (px, torch.tensor([list(px.shape[-2:])] * len(px)),
                    [self.bounds[0] + self.image_token * (self.extra * n) + self.bounds[1] for n in counts])
        if self.layout == "lfm2_vl":                 # (each picture one or more tiles: a row of pixel_values each)
            out = self.image_processor(pictures)
            return (out["pixel_values"], out["spatial_shapes"],
                    [self.image_processor.image_tokens(r, c, size) for r, c, size in
                     zip(out["image_rows"], out["image_cols"], out["image_sizes"])])
        if self.layout == "qwen":
            out = self.image_processor(pictures, return_tensors="pt")
            grids = torch.as_tensor(out["image_grid_thw"])
            return (out["pixel_values"], grids,
                    [self.image_token * (int(g.prod()) // self.merge ** 2) for g in grids])
        if self.layout == "llama4":                  # (tiles of one size, and the whole image's)
            tiled = [self.image_processor.tiles(p) for p in pictures]
            px = torch.cat([t for t, _ in tiled])
            return px, torch.tensor([list(px.shape[-2:])] * len(px)), [image_text(r, self.extra) for _, r in tiled]
        if self.layout == "llava":                   # (LLaVA's: every image resized and cropped to one size)
            px = self.image_processor(pictures, return_tensors="pt")["pixel_values"]
            sizes = torch.tensor([list(px.shape[-2:])] * len(px))
            return px, sizes, [self.image_tokens(int(h), int(w)) for h, w in sizes.tolist()]
        out = self.image_processor(pictures, patch_size={"height": self.patch, "width": self.patch},
                                   return_tensors="pt")
        sizes = torch.as_tensor(out["image_sizes"])
        return out["pixel_values"], sizes, [self.image_tokens(int(h), int(w)) for h, w in sizes.tolist()]

    def image_tokens(self, height: int, width: int) -> str:
        if self.layout == "llava":
            return self.image_token * ((height // self.patch) * (width // self.patch) + self.extra)
        row = [self.image_token] * (width // self.patch) + [self.image_break_token]
        tokens = row * (height // self.patch)
        tokens[-1] = self.image_end_token
        return "".join(tokens)

    def media_ids(self) -> list[int]:
        """The ids of the image tokens (the image's own first)."""
        return [self.tokenizer.convert_tokens_to_ids(t) for t in (self.image_token, self.image_break_token,
                                                                  self.image_end_token, self.image_begin_token)
                if t is not None]


def _merges(image_processor) -> bool:
    """Whether the image processor gives each soft token's pooled block as one row (Gemma 4 unified's)."""
    return type(image_processor).__name__ == "Gemma4UnifiedImageProcessor"


def _gemma4_unified_images(root: Path, transformers):
    """Gemma 4 unified's image processor, or where torchvision is missing (its only backend) Gemma 4's
    PIL one read from the same ``preprocessor_config.json`` (the same resize and rescale, unmerged rows)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return transformers.Gemma4ImageProcessorPil.from_pretrained(str(root))
    return transformers.AutoImageProcessor.from_pretrained(str(root))


def _gemma4_pixels(rows: torch.Tensor, positions: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's pixels (n, C, H, W; padded to the largest) and sizes (n, 2) from Gemma 4's image
    processor's rows of patches (n, P, patch * patch * C in (y, x, channel) order) and their (x, y)
    positions (-1: padding)."""
    images, sizes = [], []
    for r, pos in zip(rows, positions):
        real = (pos >= 0).all(-1)
        gw, gh = int(pos[real, 0].max()) + 1, int(pos[real, 1].max()) + 1
        c = r.shape[-1] // (patch * patch)
        order = torch.argsort(pos[real, 1] * gw + pos[real, 0])          # (row by row, as the processor cuts)
        grid = r[real][order].reshape(gh, gw, patch, patch, c).permute(4, 0, 2, 1, 3)
        images.append(grid.reshape(c, gh * patch, gw * patch))
        sizes.append([gh * patch, gw * patch])
    h, w = max(s[0] for s in sizes), max(s[1] for s in sizes)
    out = rows.new_zeros(len(images), images[0].shape[0], h, w)
    for j, im in enumerate(images):
        out[j, :, :im.shape[1], :im.shape[2]] = im
    return out, torch.tensor(sizes)


def load_processor(path: str | Path, where: str = "processor_type") -> ImageChatProcessor:
    """The image chat processor of the model directory ``path`` (its ``processor_config.json``,
    ``preprocessor_config.json``, ``tokenizer.json`` and chat template), read with transformers'
    ``PreTrainedTokenizerFast`` (the tokenizer the run's token stream uses) and
    ``AutoImageProcessor`` (its PIL backend where torchvision is missing)."""
    import json
    try:
        import transformers
    except ImportError as exc:      # pragma: no cover - the hf extra
        raise ImportError(f"{where}: reading images needs transformers: pip install 'functional_pp[hf]'") from exc
    root = Path(path)
    conf_file = root / "processor_config.json"
    conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}
    kind = conf.get("processor_class", "")
    if kind not in PROCESSORS:
        raise ValueError(f"{where}: base_model {path}'s processor is {kind or 'missing (no processor_config.json)'}; "
                         f"images are read with the layout of {' or '.join(PROCESSORS)} (Mistral 3, Pixtral, "
                         f"LLaVA-1.5, Qwen2-VL, Qwen3.5, GLM-4V, PaddleOCR-VL, Gemma 4, Gemma 4 unified, Llama 4, "
                         f"LFM2-VL, InternVL) only")
    try:
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(root))    # (tokenizer.json: the run's)
        if kind == "Llama4Processor":           # (its tiles: data/llama4_images.py, below)
            images = None
        elif kind == LFM2_VL_PROCESSOR:          # (transformers' image processor needs torchvision: ours on PIL)
            from functional_pp.data.lfm2_vl_processor import Lfm2VlImages
            images = Lfm2VlImages.from_dir(root)
        elif kind == "Gemma4UnifiedProcessor":
            images = _gemma4_unified_images(root, transformers)
        else:
            images = transformers.AutoImageProcessor.from_pretrained(str(root))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: base_model {path}: cannot load its tokenizer / image processor: {exc}") from exc
    template = conf.get("chat_template") or getattr(tok, "chat_template", None)
    for name in ("chat_template.jinja", "chat_template.json"):
        if template is None and (root / name).is_file():
            text = (root / name).read_text()
            template = json.loads(text)["chat_template"] if name.endswith(".json") else text
    if not template:
        raise ValueError(f"{where}: base_model {path} has no chat template (processor_config.json, "
                         f"chat_template.jinja or the tokenizer's)")
    if kind == "Llama4Processor":
        tiler = Llama4Tiler.from_file(root / "preprocessor_config.json")
        patch, ratio = int(conf.get("patch_size", 14)), float(conf.get("pixel_shuffle_ratio", 0.5))
        per_tile = (tiler.size // patch) ** 2 // int(round(1 / ratio ** 2))
        names = {"image_token": conf.get("image_token", "<|image|>"), "patch_token": conf.get("patch_token",
                                                                                             "<|patch|>")}
        return _known_tokens(ImageChatProcessor(tok, tiler, template, patch, image_break_token=None,
                                                image_end_token=None, layout="llama4", extra=per_tile, **names),
                             tok, path, where)
    if kind in GEMMA4_PROCESSORS:              # (a token per pooling_kernel_size² patches, between begin and end)
        pool = int(getattr(images, "pooling_kernel_size", 3))
        proc = ImageChatProcessor(tok, images, template, int(getattr(images, "patch_size", 16)) * pool,
                                  image_token=conf.get("image_token", "<|image|>"), image_break_token=None,
                                  image_end_token=conf.get("eoi_token", "<image|>"), layout="gemma4", merge=pool,
                                  image_begin_token=conf.get("boi_token", "<|image>"))
    elif kind in QWEN_PROCESSORS:
        merge = int(getattr(images, "merge_size", 2))
        proc = ImageChatProcessor(tok, images, template, int(getattr(images, "patch_size", 16)),
                                  image_token=conf.get("image_token", QWEN_PROCESSORS[kind]), image_break_token=None,
                                  image_end_token=None, layout="qwen", merge=merge,
                                  also_masked=GLM_MARKERS if kind.startswith("Glm") else ())
    elif kind == INTERNVL_PROCESSOR:          # (its tokenizer names the markers: tokenizer_config.json)
        tc_file = root / "tokenizer_config.json"
        tc = json.loads(tc_file.read_text()) if tc_file.is_file() else {}
        names = {**tc, **(tc.get("extra_special_tokens") if isinstance(tc.get("extra_special_tokens"), dict) else {})}
        size = getattr(images, "size", None) or {"height": 448}
        proc = ImageChatProcessor(tok, images, template, int(size["height"]),
                                  image_token=names.get("context_image_token", "<IMG_CONTEXT>"), image_break_token=None,
                                  image_end_token=None, layout="internvl", extra=int(conf.get("image_seq_length", 256)),
                                  bounds=(names.get("start_image_token", "<img>"), names.get("end_image_token", "</img>")))
    elif kind == LFM2_VL_PROCESSOR:
        proc = ImageChatProcessor(tok, images, template, images.encoder_patch_size, image_token="<image>",
                                  image_break_token=None, image_end_token=None, layout="lfm2_vl",
                                  merge=images.downsample_factor)
    elif kind == "LlavaProcessor":
        extra = int(conf.get("num_additional_image_tokens", 0))
        extra -= conf.get("vision_feature_select_strategy", "default") == "default"
        proc = ImageChatProcessor(tok, images, template, int(conf.get("patch_size", 16)),
                                  image_token=conf.get("image_token", "<image>"), image_break_token=None,
                                  image_end_token=None, layout="llava", extra=extra)
    else:
        patch = int(conf.get("patch_size", 16)) * int(conf.get("spatial_merge_size", 1))
        names = {k: conf[k] for k in ("image_token", "image_break_token", "image_end_token") if conf.get(k)}
        proc = ImageChatProcessor(tok, images, template, patch, **names)
    return _known_tokens(proc, tok, path, where)


def _known_tokens(proc: ImageChatProcessor, tok: Any, path: Any, where: str) -> ImageChatProcessor:
    """``proc``, once its tokenizer is found to hold each of its image tokens (else refused by name)."""
    named = [t for t in (proc.image_token, proc.image_break_token, proc.image_end_token, proc.image_begin_token,
                         proc.patch_token, *proc.bounds) if t]
    unknown = [t for t in named if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
    if unknown:
        raise ValueError(f"{where}: the tokenizer of {path} has no token {unknown[0]!r}")
    return proc


def media_token_ids(processor: ImageChatProcessor) -> list[int]:
    """The ids of the processor's image tokens (image, row break, end)."""
    return processor.media_ids()


def _messages(rec: dict, where: str) -> list[dict]:
    if isinstance(rec.get("messages"), list):
        turns = copy.deepcopy(rec["messages"])
    elif isinstance(rec.get("conversations"), list):
        roles = {"human": "user", "gpt": "assistant"}
        turns = [{"role": roles.get(t["from"], t["from"]), "content": t["value"]} for t in rec["conversations"]]
    else:
        raise ValueError(f"{where}: a chat record with images needs 'messages' (or 'conversations'); it has "
                         f"{sorted(rec)}")
    for t in turns:
        if isinstance(t.get("content"), str):
            t["content"] = [{"type": "text", "text": t["content"]}]
        t["content"] = [{k: v for k, v in c.items() if v is not None} for c in t["content"]]
    return turns


def _image(value: Any, base: Path, where: str):
    from PIL import Image
    if isinstance(value, dict):                   # a datasets Image feature as stored: bytes or path
        if value.get("bytes"):
            import io
            return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
        value = value.get("path")
    if isinstance(value, str):
        p = Path(value) if Path(value).is_absolute() else base / value
        if not p.is_file():
            raise ValueError(f"{where}: image {value!r} is not a file (paths are relative to the dataset's folder "
                             f"{base})")
        return Image.open(p).convert("RGB")
    if hasattr(value, "convert"):
        return value.convert("RGB")
    raise ValueError(f"{where}: an image is {type(value).__name__}; give a path, bytes or a PIL image")


def encode(processor, rec: dict, base: Path, where: str) -> tuple[list[int], list[int], tuple | None]:
    """``(ids, trained flags, (pixel_values, image_sizes or image_grid_thw) or None)`` of one chat record
    with images."""
    turns = _messages(rec, where)
    audio = [k for k in ("audio", "audios") if rec.get(k)] + sorted(
        {c["type"] for t in turns for c in t["content"] if c.get("type") in ("audio", "input_audio")})
    if audio:
        raise ValueError(f"{where}: audio inputs ({', '.join(audio)}) are not supported (images only): drop the "
                         f"audio from the records")
    key = next((k for k in ("images", "image") if rec.get(k) is not None), None)
    if key is not None:
        images = rec[key] if isinstance(rec[key], list) else [rec[key]]
        if images:
            img = _image(images[0], base, where)      # (Axolotl: the first image of a row)
            bare = next(((t, i) for t in turns for i, c in enumerate(t["content"])
                         if c.get("type") == "image" and not any(k in c for k in ("image", "url", "path", "base64"))),
                        None)
            if bare is not None:
                bare[0]["content"][bare[1]]["image"] = img
            else:
                user = next((t for t in turns if t["role"] == "user"), turns[0])
                user["content"].append({"type": "image", "image": img})
    for t in turns:                                  # (bare placeholders left over: no image to show)
        t["content"] = [c for c in t["content"] if c.get("type") != "image" or "image" in c]
    pictures = [c["image"] for t in turns for c in t["content"] if c.get("type") == "image"]
    text = processor.tokenizer.apply_chat_template(turns, chat_template=processor.chat_template, tokenize=False)
    pixels = sizes = None
    if pictures:
        pixels, sizes, expanded = processor.process(pictures)
        parts = text.split(processor.image_token)
        if len(parts) != len(pictures) + 1:
            raise ValueError(f"{where}: the chat template wrote {len(parts) - 1} image tokens "
                             f"{processor.image_token!r} for {len(pictures)} images")
        text = parts[0] + "".join(tokens + rest for tokens, rest in zip(expanded, parts[1:]))
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    masked = set(media_token_ids(processor))
    known = {processor.tokenizer.convert_tokens_to_ids(t) for t in processor.also_masked}
    masked |= known - {None, getattr(processor.tokenizer, "unk_token_id", None)}
    pad = getattr(processor.tokenizer, "pad_token_id", None)
    if pad is not None:
        masked.add(pad)
    mask = [0 if i in masked else 1 for i in ids]
    if processor.reply_after is not None:
        mask = [m & r for m, r in zip(mask, _replies(ids, processor.tokenizer.convert_tokens_to_ids(
            processor.reply_after), processor.tokenizer.eos_token_id))]
    return ids, mask, None if pixels is None else (pixels.float(), sizes)


def _replies(ids: list[int], opener: int, eos: int | None) -> list[int]:
    """1 on each reply's tokens: after an ``opener`` through the next ``eos`` (included), else 0."""
    out, inside = [], False
    for i in ids:
        out.append(int(inside))
        if i == opener:
            inside = True
        elif i == eos:
            inside = False
    return out


@dataclass
class RowImages:
    """Each row's images (``(pixel_values, image_sizes)`` or None) of a stream of one example per
    row, and how the model cuts them (its patch size, ``spatial_merge_size`` and image token)."""

    rows: list
    patch: int
    merge: int
    image_token_id: int
    # Qwen's tower (data/qwen_images.py: side, channels, temporal_patch): the rows hold its patches and
    # image_grid_thw (None: Pixtral's, pixels and image_sizes)
    qwen: dict | None = None
    class_token: str | None = None           # (a CLIP tower, Llama 4's tiles: data/images.py's image_batch)
    image_size: int | None = None
    # a SigLIP2 tower (data/siglip2_images.py: side, channels): the rows hold its tiles' patches and
    # spatial_shapes; every batch reads as many position taps as the stream's images need
    siglip2: dict | None = None
    groups: bool = False                     # (image_groups: Gemma 4 unified's bidirectional image tokens)

    def __post_init__(self) -> None:
        k = (self.image_size // self.patch) ** 2 + 1 if self.class_token == "trailing" else self.merge ** 2
        lead = 1 if self.class_token else 0
        self.taps = max([1] + [tap_count(r[1], self.siglip2["side"]) for r in self.rows if r is not None]) \
            if self.siglip2 is not None else None
        counts = [int(r[1].prod(-1).sum()) if self.qwen is not None or self.siglip2 is not None else
                  sum((int(h) // self.patch) * (int(w) // self.patch) + lead for h, w in r[1].tolist())
                  for r in self.rows if r is not None]
        self.patches = -(-max([k] + counts) // k) * k   # every batch padded alike (whole merged tokens): mesh- and
        #                                                 step-independent

    def entries(self, rows: Sequence[int], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The image entries (data/images.py) of stream rows ``rows`` whose tokens are ``ids``."""
        picked = [self.rows[r] if 0 <= r < len(self.rows) else None for r in rows]
        if self.siglip2 is not None:
            return siglip2_image_batch(ids, [p[0] if p else None for p in picked], [p[1] if p else None for p in picked],
                                       merge=self.merge, image_token_id=self.image_token_id, patch=self.patch,
                                       patches=self.patches, taps=self.taps, **self.siglip2)
        if self.qwen is not None:
            return qwen_image_batch(ids, [p[0] if p else None for p in picked], [p[1] if p else None for p in picked],
                                    merge=self.merge, image_token_id=self.image_token_id, patch=self.patch,
                                    patches=self.patches, **self.qwen)
        return image_batch(ids, [p[0] if p else None for p in picked], [p[1] if p else None for p in picked],
                           patch=self.patch, merge=self.merge, image_token_id=self.image_token_id,
                           patches=self.patches, class_token=self.class_token, image_size=self.image_size,
                           groups=self.groups)
