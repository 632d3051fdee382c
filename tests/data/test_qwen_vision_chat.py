"""Chat rows with images for a Qwen vision-language model (``processor_type: AutoProcessor`` with a
Qwen processor: data/vision_chat.py's Qwen layout, data/qwen_images.py): each ``<|image_pad|>``
expanded into one per merged patch of ``Qwen2VLImageProcessor``'s grid, labels masking it and the
padding (Axolotl's Qwen2-VL strategy); the first loss of ``functional-pp train`` on two simulated
FSDP devices equals transformers' ``Qwen3_5ForConditionalGeneration`` on the loader's first batch."""
import json

import pytest
import torch
from chat_tokenizer import make_qwen_vl_processor
from image_chat import (assert_first_loss_equals, cli_first_step, hf_loss, random_sizes, write_image_rows,
                        write_train_yaml)

from functional_pp.config import TrainConfig
from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
    pytest.skip("transformers without Qwen3.5", allow_module_level=True)

PAD, START, END = 260, 259, 261          # <|image_pad|>, <|vision_start|>, <|vision_end|>
TEXT = dict(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6, layer_types=["linear_attention", "full_attention"],
            initializer_range=0.2, pad_token_id=None, bos_token_id=None, eos_token_id=256,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[2, 1, 1]))
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_vlm")
    d = root / "model"
    torch.manual_seed(0)
    conf = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, image_token_id=PAD,
                                      video_token_id=262, vision_start_token_id=START, vision_end_token_id=END)
    transformers.Qwen3_5ForConditionalGeneration(conf).save_pretrained(d)
    make_qwen_vl_processor(d)
    data = write_image_rows(root / "data", random_sizes(8, 30, first=(20, 13)), count=8)
    return d, data


def test_rows_are_encoded_as_axolotl_encodes_them(files):
    d, data = files
    proc = load_processor(d)
    rec = json.loads(data.read_text().splitlines()[0])
    ids, mask, (pixels, grids) = encode(proc, rec, data.parent, "row 0")
    assert grids.tolist() == [[1, 4, 4]]              # 20 x 13 resized by Qwen2VLImageProcessor: 16 x 16 pixels
    assert tuple(pixels.shape) == (16, 3 * 2 * 4 * 4)     # one row per patch (channels x temporal x patch²)
    first = ids.index(PAD)
    assert ids[first - 1:first + 5] == [START] + [PAD] * 4 + [END]      # one pad per merged 2 x 2 patches
    assert [m for i, m in zip(ids, mask) if i == PAD] == [0] * 4           # not trained
    assert all(m == 1 for i, m in zip(ids, mask) if i != PAD)              # every other token (no roles)


def test_loader_entries_and_cli_first_loss_equal_transformers(files, tmp_path):
    d, data = files
    step = cli_first_step(write_train_yaml(tmp_path, d, data, 96, dp_shard_size=2))
    assert sum(r is not None for r in step.train.images.rows) == 8 and step.train.images.rows[8] is None
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    want = hf_loss(model, step.batch, pixel_values=torch.cat([p for p, _ in step.images]),
                   image_grid_thw=torch.cat([g for _, g in step.images]),
                   mm_token_type_ids=(step.batch["tokens"] == PAD).int())
    assert_first_loss_equals(step, want, PAD)


def test_a_processor_of_another_layout_is_refused_by_name(files, tmp_path):
    d, data = files
    from functional_pp.app.inputs import image_settings
    (tmp_path / "m").mkdir()
    import shutil
    for f in d.iterdir():
        shutil.copy(f, tmp_path / "m" / f.name)
    conf = json.loads((tmp_path / "m" / "preprocessor_config.json").read_text())
    (tmp_path / "m" / "preprocessor_config.json").write_text(json.dumps(dict(conf, merge_size=1)))
    cfg = TrainConfig.from_yaml(write_train_yaml(tmp_path, tmp_path / "m", data, 96))
    with pytest.raises(ValueError, match="merged 1 x 1 with image token id 260, its model 4-pixel patches"):
        image_settings(cfg)
