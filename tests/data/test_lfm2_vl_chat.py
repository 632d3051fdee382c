"""Chat rows with images for LFM2-VL (``processor_type: AutoProcessor`` with ``Lfm2VlProcessor``:
data/lfm2_vl_processor.py, its image processor on PIL; data/siglip2_images.py's entries): each
``<image>`` expanded as transformers' processor expands it (tiles, thumbnail, markers), the
labels masking ``<image>`` and the padding (Axolotl's base strategy); the first loss of
``functional-pp train`` on two simulated FSDP devices equals transformers'
``Lfm2VlForConditionalGeneration`` on the loader's first batch and the processor's pixels."""
import json

import numpy as np
import pytest
import torch
from chat_tokenizer import make_lfm2_vl_processor
from image_chat import assert_first_loss_equals, cli_first_step, hf_loss, write_image_rows, write_train_yaml

from functional_pp.config import TrainConfig
from functional_pp.data.lfm2_vl_processor import Lfm2VlImages
from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
if not hasattr(transformers, "Lfm2VlForConditionalGeneration"):
    pytest.skip("transformers without LFM2-VL", allow_module_level=True)

IMAGE, START, END, THUMB = 261, 260, 262, 263
TEXT = dict(model_type="lfm2", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=288, layer_types=["conv", "full_attention"], pad_token_id=259,
            bos_token_id=256, eos_token_id=258)
VISION = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, patch_size=4, num_patches=16, vision_use_head=False)
SIZES = [(40, 24), (12, 20), (30, 30), (9, 14), (16, 40), (20, 20)]      # (height, width): split, whole, ...


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfm2_vlm")
    d = root / "model"
    torch.manual_seed(0)
    conf = transformers.Lfm2VlConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                                     projector_hidden_size=48, downsample_factor=2)
    transformers.Lfm2VlForConditionalGeneration(conf).save_pretrained(d)
    make_lfm2_vl_processor(d)
    data = write_image_rows(root / "data", SIZES)
    return d, data


def hf_tokens(rows, cols, size, images: Lfm2VlImages) -> str:
    """transformers' Lfm2VlProcessor's expansion of one image (its own token builder and counts)."""
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor
    proc = Lfm2VlProcessor.__new__(Lfm2VlProcessor)            # (its tokenizer and image processor not needed)
    proc.image_token, proc.image_start_token = "<image>", "<|image_start|>"
    proc.image_end_token, proc.image_thumbnail_token = "<|image_end|>", "<|img_thumbnail|>"
    per_tile = proc._compute_tokens_per_tile(images.tile_size, images.encoder_patch_size, images.downsample_factor)
    whole = proc._compute_tokens_for_image(size, images.encoder_patch_size, images.downsample_factor)
    return proc._build_image_tokens(rows, cols, per_tile, whole, images.use_thumbnail, True)


def test_rows_are_encoded_as_the_processor_encodes_them(files):
    d, data = files
    proc = load_processor(d)
    images = proc.image_processor
    for i, line in enumerate(data.read_text().splitlines()[:len(SIZES)]):
        rec = json.loads(line)
        ids, mask, (pixels, shapes) = encode(proc, rec, data.parent, f"row {i}")
        rows, cols, h, w = images.layout(*SIZES[i])
        want = proc.tokenizer(hf_tokens(rows, cols, [h, w], images), add_special_tokens=False)["input_ids"]
        first = ids.index(START)
        assert ids[first:first + len(want)] == want, i
        assert len(pixels) == len(shapes) == (rows * cols + 1 if rows * cols > 1 else 1)
        assert int((shapes // 2).prod(-1).sum()) == ids.count(IMAGE)       # one token per 2 x 2 patches
        assert h % 8 == 0 and w % 8 == 0 and [m for t, m in zip(ids, mask) if t == IMAGE] == [0] * ids.count(IMAGE)
        assert all(m == 1 for t, m in zip(ids, mask) if t != IMAGE)
    assert images.layout(40, 24)[:2] == (2, 1) and images.layout(12, 20)[:2] == (1, 1)   # split / whole


def test_pixels_are_the_normalised_patches_row_by_row(files, tmp_path):
    """An image already at its resized size (PIL's resize to the same size is the identity): its patches,
    each patch's pixels row by row with the channels innermost (convert_image_to_patches), rescaled and
    normalised; padded to max_num_patches with the attention mask."""
    d, _ = files
    images = Lfm2VlImages.from_dir(d)
    x = (np.random.default_rng(1).random((8, 16, 3)) * 255).astype("uint8")
    assert images.layout(8, 16) == (1, 1, 8, 16)
    out = images([Image.fromarray(x)])
    want = torch.from_numpy(x.astype(np.float32)).reshape(2, 4, 4, 4, 3).permute(0, 2, 1, 3, 4).reshape(8, 48)
    torch.testing.assert_close(out["pixel_values"][0, :8], (want / 255 - 0.5) / 0.5)
    assert out["spatial_shapes"].tolist() == [[2, 4]] and out["pixel_values"].shape == (1, 16, 48)
    assert out["pixel_attention_mask"][0].tolist() == [1] * 8 + [0] * 8 and not out["pixel_values"][0, 8:].any()


def test_loader_entries_and_cli_first_loss_equal_transformers(files, tmp_path):
    d, data = files
    step = cli_first_step(write_train_yaml(tmp_path, d, data, 96, dp_shard_size=2))
    rows = step.train.images.rows
    assert sum(r is not None for r in rows) == len(SIZES) and rows[len(SIZES)] is None
    model = transformers.Lfm2VlForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    shapes = torch.cat([s for _, s in step.images])
    want = hf_loss(model, step.batch, pixel_values=torch.cat([p for p, _ in step.images]), spatial_shapes=shapes,
                   pixel_attention_mask=(torch.arange(16) < shapes.prod(-1)[:, None]).long())
    assert_first_loss_equals(step, want, IMAGE)


def test_a_processor_of_another_layout_is_refused_by_name(files, tmp_path):
    d, data = files
    import shutil

    from functional_pp.app.inputs import image_settings
    (tmp_path / "m").mkdir()
    for f in d.iterdir():
        shutil.copy(f, tmp_path / "m" / f.name)
    conf = json.loads((tmp_path / "m" / "preprocessor_config.json").read_text())
    (tmp_path / "m" / "preprocessor_config.json").write_text(json.dumps(dict(conf, downsample_factor=1)))
    cfg = TrainConfig.from_yaml(write_train_yaml(tmp_path, tmp_path / "m", data, 96))
    with pytest.raises(ValueError, match="downsampled 1 x 1 with image token id 261, its model 4-pixel patches"):
        image_settings(cfg)
