"""The checks the vision-language families' tests share (tests/models/test_{gemma4_vision,
gemma4_unified, glm4v, internvl, lfm2_vl, llama4_vision, llava_clip, paddleocr_vl, pixtral,
qwen3_5_vision}.py): a family's tiny rows with images (:class:`ImageRows`), and its loss, gradients,
layouts, LoRA and export against transformers, peft and one device."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from harness import parallel, peft_lora, single_device, train_adapters, train_steps

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.adapters import peft_dir
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.data.images import IMAGE_DIMS
from functional_pp.models import llama, llama_hf
from functional_pp.parallel import sharding

BATCH_DIMS = {"tokens": "batch seq", "labels": "batch seq", **IMAGE_DIMS}
"""The dimensions of a training batch with images (``train_steps`` / ``train_adapters``' ``batch_dims``)."""

LAYOUTS = {"fsdp": (fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)),
           "tp": (fpp.Mesh(tp=2), llama.default_rules(fsdp=False)),
           "cp": (fpp.Mesh(cp=2), llama.default_rules(tp=False, fsdp=False))}
"""Two simulated devices of each kind, as the families' layout tests run them."""


def config_of(raw: dict):
    """Our config of a multimodal ``config.json`` (its text decoder's and its tower's)."""
    return dataclasses.replace(hf.config_from_hf(raw), vision=llama_hf.vision_from_hf(raw))


def saved_config(model, d) -> object:
    """Save transformers' ``model`` to ``d``; our config of what it wrote."""
    model.save_pretrained(d, safe_serialization=True)
    return config_of(json.loads((d / "config.json").read_text()))


@dataclass(frozen=True)
class ImageRows:
    """A family's test rows with images, as each side takes them: ``rows(seed=, seq=, dtype=)`` gives
    token ids and each row's pixels, ``hf_inputs(ids, pixels)`` transformers' keyword arguments,
    ``entries(ids, pixels, cfg)`` our image entries (data/images.py's); ``hf_class`` names the
    multimodal class in transformers, ``image_token_id`` the image token."""
    hf_class: str
    image_token_id: int
    rows: Callable
    hf_inputs: Callable[..., dict]
    entries: Callable[..., dict]

    def labels(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token labels with the image tokens masked (-100), as Axolotl's multimodal collator."""
        lab = ids[:, 1:].clone()
        lab[lab == self.image_token_id] = -100
        return lab

    def batch(self, ids: torch.Tensor, pixels, cfg) -> dict:
        """A training batch: tokens, labels and the image entries (the per-token ones cut to the tokens)."""
        cut = {k: v[:, :-1] if "seq" in IMAGE_DIMS[k].split() else v
               for k, v in self.entries(ids, pixels, cfg).items()}
        return {"tokens": ids[:, :-1], "labels": self.labels(ids), **cut}

    def logits(self, params: dict, cfg, ids: torch.Tensor, pixels=None, lc=None) -> torch.Tensor:
        """Our logits of ``ids`` with their images (text alone without ``pixels``; ``lc``: the adapters
        in ``params`` applied)."""
        dtype = next(iter(tree.leaves_with_paths(params)))[1].dtype
        decls = llama.init(cfg, dtype)
        if lc is not None:
            decls = adapters.init(decls, lc, cfg.model_type)
        forward = llama.forward if lc is None else adapters.adapt(llama.forward, lc)
        images = None if pixels is None else {k: fpp.wrap(v, IMAGE_DIMS[k])
                                              for k, v in self.entries(ids, pixels, cfg).items()}
        with torch.no_grad():
            return forward(sharding.named_tree(params, decls), fpp.wrap(ids, "batch seq"), cfg, images=images).value()

    def hf_model(self, d, dtype=torch.float64):
        """transformers' multimodal class loaded from ``d`` (eager attention)."""
        import transformers
        return getattr(transformers, self.hf_class).from_pretrained(d, dtype=dtype, attn_implementation="eager")

    def hf_loss(self, model, ids: torch.Tensor, pixels) -> torch.Tensor:
        """transformers' next-token loss of ``model`` on the rows, backpropagated into its ``.grad``."""
        logits = model(**self.hf_inputs(ids, pixels)).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.labels(ids).reshape(-1))
        loss.backward()
        return loss.detach()


GRIDS = [[(1, 4, 6), (1, 2, 2)], [(1, 2, 4)], [], [(1, 6, 2)]]
"""The images of :func:`grid_case`'s four rows: their (t, h, w) in patches (6 + 1, 2, 0 and 3 image tokens
of 2 x 2 merged patches)."""


def grid_case(hf_class: str, image_token_id: int, patch_shape: tuple[int, ...], entries: Callable) -> ImageRows:
    """The rows of the towers that take a grid of patches per image (Qwen's, GLM-4V's, PaddleOCR-VL's):
    four rows with the images of :data:`GRIDS` (each patch's pixels of ``patch_shape``); transformers
    takes them as ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``; ``entries``: ours."""
    def rows(seed=0, seq=16, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 240, (len(GRIDS), seq), generator=g)
        ids[0, 2:8], ids[0, 10], ids[1, 5:7], ids[3, 9:12] = (image_token_id,) * 4
        pixels = [torch.randn(sum(t * h * w for t, h, w in gr), *patch_shape, generator=g, dtype=dtype) if gr else None
                  for gr in GRIDS]
        return ids, pixels

    def hf_inputs(ids, pixels):
        return dict(input_ids=ids, pixel_values=torch.cat([p for p in pixels if p is not None]),
                    image_grid_thw=torch.tensor([x for gr in GRIDS for x in gr]),
                    mm_token_type_ids=(ids == image_token_id).int())
    return ImageRows(hf_class, image_token_id, rows, hf_inputs, entries)


def sized_case(hf_class: str, image_token_id: int, sizes: list[list[tuple[int, int]]], side: int,
               spans: dict[int, list[tuple[int, int]]], *, seq: int, image_sizes: bool = True,
               **image_kw) -> ImageRows:
    """The rows of the towers that take each image whole (Pixtral's, CLIP's): one row per entry of
    ``sizes`` (its images' (height, width) in pixels, each image ``side`` x ``side`` pixels of N(0, 1)),
    ids in [0, 300) with the image token over each row's ``spans`` ((start, end) columns), ``seq`` long
    by default; transformers takes ``pixel_values`` (and ``image_sizes`` where ``image_sizes``), ours
    ``image_batch``'s entries (``image_kw``: its patch, merge and tower settings)."""
    from functional_pp.data.images import image_batch

    def rows(seed=0, seq=seq, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 300, (len(sizes), seq), generator=g)
        for row, row_spans in spans.items():
            for start, end in row_spans:
                ids[row, start:end] = image_token_id
        pixels = [torch.randn(len(s), 3, side, side, generator=g, dtype=dtype) if s else None for s in sizes]
        return ids, pixels

    def hf_inputs(ids, pixels):
        extra = {"image_sizes": torch.tensor([x for s in sizes for x in s])} if image_sizes else {}
        return dict(input_ids=ids, pixel_values=torch.cat([p for p in pixels if p is not None]), **extra)

    def entries(ids, pixels, cfg=None):
        return image_batch(ids, pixels, [torch.tensor(s) if s else None for s in sizes],
                           image_token_id=image_token_id, **image_kw)
    return ImageRows(hf_class, image_token_id, rows, hf_inputs, entries)


def padded_images(images: list[torch.Tensor]) -> torch.Tensor:
    """Images (C, H, W) stacked, each padded with zeros at the bottom and right to the largest."""
    h, w = max(im.shape[1] for im in images), max(im.shape[2] for im in images)
    return torch.stack([F.pad(im, (0, w - im.shape[2], 0, h - im.shape[1])) for im in images])


def flat_patches(images: list[torch.Tensor], side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 4's image processors' pixels: each image's ``side`` x ``side`` patches row by row, each
    as its (y, x, channel) pixels, and their (x, y) positions, padded to the most patches (positions
    -1)."""
    most = max(im.shape[1] * im.shape[2] // side ** 2 for im in images)
    values, positions = [], []
    for im in images:
        c, h, w = im.shape
        patches = im.reshape(c, h // side, side, w // side, side).permute(1, 3, 2, 4, 0).reshape(-1, side * side * c)
        y, x = torch.meshgrid(torch.arange(h // side), torch.arange(w // side), indexing="ij")
        pos = torch.stack([x.reshape(-1), y.reshape(-1)], -1)
        pad = most - len(patches)
        values.append(torch.cat([patches, patches.new_zeros(pad, patches.shape[1])]))
        positions.append(torch.cat([pos, torch.full((pad, 2), -1)]))
    return torch.stack(values), torch.stack(positions)


def _agree(got: torch.Tensor, want: torch.Tensor, rtol: float, scale: float, floor: float, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=max(scale * want.abs().max().item(), floor),
                               msg=lambda m: f"{what}: {m}")


POOLED = [[(4, 6), (2, 2)], [(2, 4)], [], [(6, 2)]]
"""The images of :func:`pooled_case`'s four rows: their (rows, columns) of patches."""


def pooled_case(hf_class: str, tokens: tuple[int, int, int], patch: int, pool: int, hf_patch: int,
                groups: bool = False) -> ImageRows:
    """The rows of Gemma 4's towers (its encoder's, the unified embedder's): four rows with the images
    of :data:`POOLED` (``patch``-pixel patches, C x H x W in [0, 1]), each image's ``tokens`` (image,
    begin, end: one image token per ``pool`` x ``pool`` patches); transformers takes each image's
    ``hf_patch``-pixel patches (:func:`flat_patches`), ours data/images.py's entries (``groups``: the
    image tokens' groups)."""
    from functional_pp.data.images import image_batch
    image, boi, eoi = tokens

    def rows(seed=0, seq=16, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, 240, (len(POOLED), seq), generator=g)
        ids[0, 1], ids[0, 2:8], ids[0, 8], ids[0, 10], ids[0, 11], ids[0, 12] = boi, image, eoi, boi, image, eoi
        ids[1, 4], ids[1, 5:7], ids[1, 7] = boi, image, eoi
        ids[3, 8], ids[3, 9:12], ids[3, 12] = boi, image, eoi
        pixels = [[torch.rand(3, h * patch, w * patch, generator=g, dtype=dtype) for h, w in gr] for gr in POOLED]
        return ids, pixels

    def hf_inputs(ids, pixels):
        values, positions = flat_patches([im for row in pixels for im in row], hf_patch)
        return dict(input_ids=ids, pixel_values=values, image_position_ids=positions,
                    mm_token_type_ids=(ids == image).int())

    def entries(ids, pixels, cfg=None):
        sizes = [torch.tensor([im.shape[1:] for im in row]) if row else None for row in pixels]
        return image_batch(ids, [padded_images(row) if row else None for row in pixels], sizes, patch=patch,
                           merge=pool, image_token_id=image, groups=groups)
    return ImageRows(hf_class, image, rows, hf_inputs, entries)


def assert_logits_equal_hf(case: ImageRows, model, d, cfg, atol: float, rtol: float = 1e-5,
                           dtype: torch.dtype | None = None):
    """Our logits of rows of seed 0 equal transformers' ``model``'s (``atol`` / ``rtol``; ``dtype``: the
    parameters' and rows', default the checkpoint's and float32); without the images they differ (by
    more than 0.1), and without their 3D positions where the entries hold them (1e-3); a row without
    images is its text alone's (1e-5). Returns the parameters, the rows and transformers' logits."""
    params = hf.load_hf_params(d, cfg, dtype=dtype)
    ids, pixels = case.rows(dtype=dtype or torch.float32)
    with torch.no_grad():
        want = model(**case.hf_inputs(ids, pixels)).logits
    got, text_only = case.logits(params, cfg, ids, pixels), case.logits(params, cfg, ids)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert (text_only - want).abs().max() > 0.1                                      # the images matter
    if "mrope_positions" in case.entries(ids, pixels, cfg):                         # so do their 3D positions
        flat = dataclasses.replace(case, entries=lambda *a: {k: v for k, v in case.entries(*a).items()
                                                             if k != "mrope_positions"})
        assert (flat.logits(params, cfg, ids, pixels) - want).abs().max() > 1e-3
    for row in (i for i, p in enumerate(pixels) if p is None or not len(p)):
        torch.testing.assert_close(text_only[row], want[row], atol=1e-5, rtol=1e-5)
    return params, (ids, pixels), want


def assert_loss_and_grads_equal_hf(case: ImageRows, d, cfg, *, seed: int = 1, loss_rtol: float = 1e-7,
                                   rtol: float = 1e-4,
                                   scale: float = 1e-5, floor: float = 1e-9,
                                   module: Callable[[str, str], str] | None = None,
                                   constants: tuple[str, ...] = ()) -> set[str]:
    """One fp64 step on rows of ``seed``: our loss equals transformers' (``loss_rtol``), and the
    gradient of each of the files' tensors (its parts fused) equals transformers' of its module
    (``module(file name, our path)``; default the file name) within ``rtol`` and atol = ``scale`` x
    its largest (at least ``floor``); files' tensors ending in ``constants`` have none there (ours
    zero). Every gradient transformers has is compared. Returns the files' names."""
    model = case.hf_model(d)
    ids, pixels = case.rows(seed=seed, dtype=torch.float64)
    loss, grads = single_device(cfg, hf.load_hf_params(d, cfg, dtype=torch.float64), case.batch(ids, pixels, cfg))
    torch.testing.assert_close(loss, case.hf_loss(model, ids, pixels), rtol=loss_rtol, atol=0)
    theirs = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ours = dict(tree.leaves_with_paths(grads))
    files = hf._file_tensors(llama.init(cfg), cfg)
    compared = set()
    for name, parts in files:
        if name.endswith(constants):
            assert torch.equal(ours[parts[0][0]], torch.zeros_like(ours[parts[0][0]])), name
            continue
        key = module(name, parts[0][0]) if module else name
        _agree(torch.cat([kind.to_hf(ours[p]) for p, kind, _ in parts]), theirs[key], rtol, scale, floor, name)
        compared.add(key)
    assert compared == set(theirs), sorted(set(theirs) ^ compared)
    return {name for name, _ in files}


def renaming(*pairs: tuple[str, str]) -> Callable[[str], str]:
    """A name with the first of ``(old prefix, new prefix)`` pairs it starts with replaced."""
    def rename(name: str, *_) -> str:
        return next((new + name[len(old):] for old, new in pairs if name.startswith(old)), name)
    return rename


def assert_layout_equals_one_device(cfg, params: dict, batch: dict, layout: str) -> None:
    """One fp64 step of ``batch`` under ``layout`` (:data:`LAYOUTS`) on simulated devices: every
    device's loss and gathered gradients equal one device's."""
    mesh, rules = LAYOUTS[layout]
    loss0, grads0 = single_device(cfg, params, batch)
    for rank, (loss, grads, _) in enumerate(parallel(cfg, params, batch, mesh, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


def assert_rows_layout_equals_one_device(case: ImageRows, d, cfg, layout: str, seq: int = 16) -> None:
    """:func:`assert_layout_equals_one_device` on the checkpoint ``d`` and rows of seed 2."""
    batch = case.batch(*case.rows(seed=2, seq=seq, dtype=torch.float64), cfg)
    assert_layout_equals_one_device(cfg, hf.load_hf_params(d, cfg, dtype=torch.float64), batch, layout)


def assert_processes_equal_one_device(case: ImageRows, cfg, seeds=(0, 1), atol: float = 1e-12) -> dict:
    """AdamW steps (one per rows of ``seeds``) with images on DP x FSDP (2 x 2) as four real gloo
    processes equal one device's: losses and parameters (``atol``). Returns one device's parameters."""
    data = [case.batch(*case.rows(seed=s, dtype=torch.float64), cfg) for s in seeds]
    return assert_runs_on_processes_equal_one_device([(cfg, data)], atol)[0]


def assert_runs_on_processes_equal_one_device(runs: list[tuple[object, list[dict]]], atol: float = 1e-12) -> list[dict]:
    """:func:`assert_processes_equal_one_device` for several models in one launch: each ``(cfg, batches)``
    of ``runs`` trained in turn by the same four gloo processes. Returns one device's parameters of each."""
    def all_runs(mesh, rules):
        steps = [train_steps(cfg, data, mesh, rules, batch_dims=BATCH_DIMS) for cfg, data in runs]
        return lambda: [step() for step in steps]
    ones = fpp.launch(all_runs(fpp.Mesh(), fpp.Rules()), fpp.Mesh())[0]
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2)
    for got in fpp.launch(all_runs(mesh, llama.default_rules(tp=False)), mesh, processes=True, timeout=600):
        for (losses, params, _), one in zip(got, ones, strict=True):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=1e-10, atol=0)
            for p, x in params.items():
                torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one[1][p]), rtol=1e-8, atol=atol,
                                           msg=lambda m: f"{p}: {m}")
    return [one[1] for one in ones]


def assert_lora_equals_peft(case: ImageRows, d, cfg, targets, *, seed: int, rows_seed: int, count: int,
                            loss_rtol: float = 1e-7, rtol: float = 1e-4, scale: float = 1e-5, floor: float = 0.0,
                            peft_name: Callable[[str], str] = lambda k: k) -> SimpleNamespace:
    """LoRA (r 4, alpha 8; ``harness.peft_lora``'s random B, ``seed``) on ``targets`` of transformers'
    model and ours, one fp64 step on rows of ``rows_seed``: the loss (``loss_rtol``) and every one of
    the ``count`` adapter gradients (``rtol``, atol ``scale`` x its largest, at least ``floor``) equal
    peft's. ``peft_name``: peft's names -> a PEFT directory's (where transformers' modules are named
    otherwise than the files). Returns peft's model, our full tree, the LoRA config, peft's gradients
    and logits."""
    wrapper = cfg.text_of or cfg.model_type
    pm = peft_lora(case.hf_model(d), targets, seed=seed)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=targets)
    decls = adapters.init(llama.init(cfg, torch.float64), lc, cfg.model_type)
    state = {peft_name(k.replace(".default", "")): v.detach().clone() for k, v in pm.state_dict().items()
             if "lora_" in k}
    full = adapters.joined(hf.load_hf_params(d, cfg, dtype=torch.float64), peft_dir.from_peft(state, decls, wrapper))
    ids, pixels = case.rows(seed=rows_seed, dtype=torch.float64)
    losses, grads, _ = train_adapters(cfg, lc, decls, full, [case.batch(ids, pixels, cfg)], fpp.Mesh(), fpp.Rules(),
                                      batch_dims=BATCH_DIMS)[0]
    logits = pm(**case.hf_inputs(ids, pixels)).logits[:, :-1]
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), case.labels(ids).reshape(-1))
    ref.backward()
    torch.testing.assert_close(torch.tensor(losses[0], dtype=torch.float64), ref.detach(), rtol=loss_rtol, atol=0)
    got = peft_dir.to_peft(grads, wrapper)
    want = {peft_name(k.replace(".default", "")): p.grad for k, p in pm.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and len(want) == count, (len(want), sorted(want))
    for k, w in want.items():
        assert w.abs().max() > 0, k
        _agree(got[k], w, rtol, scale, floor, f"grad {k}")
    return SimpleNamespace(peft_model=pm, full=full, lc=lc, grads=want, logits=logits.detach(), rows=(ids, pixels))


def assert_export_equals_hf(case: ImageRows, src, cfg, out, model_type: str, rtol: float = 1e-5,
                            atol: float = 5e-5) -> dict:
    """Parameters of ``src`` moved off the checkpoint's values (0.05 N(0, 1)), exported to ``out``: the
    config is ``case.hf_class``'s of ``model_type`` and reads back as ``cfg``; the files hold the
    checkpoint's tensor names and import back bitwise; transformers loads them with our fp64 logits
    on rows of seed 4 (``rtol`` / ``atol``). Returns the written config."""
    from safetensors.torch import load_file
    params = hf.load_hf_params(src, cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    params = tree.tree_map(lambda t: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype), params)
    hf.save_hf_llama(params, cfg, out)
    raw = json.loads((out / "config.json").read_text())
    assert (raw["architectures"], raw["model_type"]) == ([case.hf_class], model_type)
    assert config_of(raw) == cfg
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(src / "model.safetensors")))
    back = dict(tree.leaves_with_paths(hf.load_hf_params(out, cfg, dtype=torch.float64)))
    for path, t in tree.leaves_with_paths(params):
        assert torch.equal(back[path], t), path
    model = case.hf_model(out).eval()
    ids, pixels = case.rows(seed=4, dtype=torch.float64)
    with torch.no_grad():
        want = model(**case.hf_inputs(ids, pixels)).logits
    torch.testing.assert_close(case.logits(params, cfg, ids, pixels), want, rtol=rtol, atol=atol)
    return raw
