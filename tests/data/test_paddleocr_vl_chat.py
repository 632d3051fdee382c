"""Chat rows with images for PaddleOCR-VL (``processor_type: AutoProcessor`` with its
``PaddleOCRVLProcessor``: data/vision_chat.py's Qwen layout, its image processor on PIL): each
``<|IMAGE_PLACEHOLDER|>`` expanded into one per merged patch, labels masking it (Axolotl's chat_template
strategy with a processor), the raster-ordered patches put in merge order; the first loss of
``functional-pp train`` with ``full_finetune: true`` on two simulated FSDP devices equals transformers'
``PaddleOCRVLForConditionalGeneration`` on the loader's first batch."""
import json

import pytest
import torch
from chat_tokenizer import make_paddleocr_vl_processor
from image_chat import (assert_first_loss_equals, cli_first_step, hf_loss, random_sizes, write_image_rows,
                        write_train_yaml)

from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
if not hasattr(transformers, "PaddleOCRVLForConditionalGeneration"):
    pytest.skip("transformers without PaddleOCR-VL", allow_module_level=True)

START, PAD, END = 257, 258, 259          # <|IMAGE_START|>, <|IMAGE_PLACEHOLDER|>, <|IMAGE_END|>
TEXT = dict(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, use_bias=True, pad_token_id=None, bos_token_id=None, eos_token_id=256,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]))
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
              spatial_merge_size=2, image_size=12)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("paddleocr_vlm")
    d = root / "model"
    torch.manual_seed(0)
    conf = transformers.PaddleOCRVLConfig(text_config=TEXT, vision_config=VISION, image_token_id=PAD)
    model = transformers.PaddleOCRVLForConditionalGeneration(conf)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.ndim == 1 or "norm" in n else p.normal_(0, 0.2)
    model.save_pretrained(d)
    make_paddleocr_vl_processor(d)
    data = write_image_rows(root / "data", random_sizes(8, 30, first=(20, 13)), count=8, question="read {i}",
                            answer="text {i}", without_image=False)
    return d, data


def test_rows_are_encoded_as_the_processor_expands_them(files):
    d, data = files
    proc = load_processor(d)
    rec = json.loads(data.read_text().splitlines()[0])
    ids, mask, (pixels, grids) = encode(proc, rec, data.parent, "row 0")
    want = transformers.PaddleOCRVLImageProcessorPil.from_pretrained(str(d))(
        [Image.open(data.parent / "img0.png").convert("RGB")], return_tensors="pt")
    assert grids.tolist() == want["image_grid_thw"].tolist() == [[1, 4, 4]]
    torch.testing.assert_close(pixels, want["pixel_values"], rtol=0, atol=0)
    first = ids.index(PAD)
    assert ids[first - 1:first + 5] == [START] + [PAD] * 4 + [END]      # one per merged 2 x 2 patches
    assert [m for i, m in zip(ids, mask) if i == PAD] == [0] * 4


def test_cli_full_finetune_first_loss_equals_transformers(files, tmp_path):
    d, data = files
    step = cli_first_step(write_train_yaml(tmp_path, d, data, 64, full_finetune=True, dp_shard_size=2))
    assert step.vision["qwen"]["raster"] and step.vision["qwen"]["resample"] == "bilinear_half"
    model = transformers.PaddleOCRVLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    want = hf_loss(model, step.batch, pixel_values=torch.cat([p for p, _ in step.images]),
                   image_grid_thw=torch.cat([g for _, g in step.images]),
                   mm_token_type_ids=(step.batch["tokens"] == PAD).int())
    assert_first_loss_equals(step, want, PAD)
