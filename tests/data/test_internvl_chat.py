"""Chat rows with images for InternVL (``processor_type: AutoProcessor`` with ``InternVLProcessor``:
data/vision_chat.py's InternVL layout, ``GotOcr2ImageProcessor``'s tiles on PIL; data/images.py's
entries, each tile's class slot after the patches): ids and pixels equal transformers'
``InternVLProcessor``, the labels masking ``<IMG_CONTEXT>`` and the padding (Axolotl's base strategy);
the first loss of ``functional-pp train`` on two simulated FSDP devices equals transformers'
``InternVLForConditionalGeneration`` on the loader's first batch."""
import json

import pytest
import torch
from chat_tokenizer import make_internvl_processor
from image_chat import assert_first_loss_equals, cli_first_step, hf_loss, write_image_rows, write_train_yaml

from functional_pp.config import TrainConfig
from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
if not hasattr(transformers, "InternVLForConditionalGeneration"):
    pytest.skip("transformers without InternVL", allow_module_level=True)

CONTEXT = 261
TEXT = dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=272, pad_token_id=258, bos_token_id=None, eos_token_id=257)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=4, attention_bias=True)
SIZES = [(40, 24), (12, 20), (30, 30), (9, 14), (16, 40), (20, 20)]      # (height, width): tiled or not


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("internvl_vlm")
    d = root / "model"
    torch.manual_seed(0)
    conf = transformers.InternVLConfig(text_config=TEXT, vision_config=VISION, image_token_id=CONTEXT,
                                       image_seq_length=4)
    transformers.InternVLForConditionalGeneration(conf).save_pretrained(d)
    make_internvl_processor(d)
    data = write_image_rows(root / "data", SIZES)
    return d, data


def test_rows_are_encoded_as_the_processor_encodes_them(files):
    d, data = files
    proc = load_processor(d)
    # transformers' InternVLProcessor (its own expansion; built without __init__, which asks for torchvision's video
    # processor) and its image processor, GotOcr2ImageProcessor's PIL backend
    hf_proc = transformers.InternVLProcessor.__new__(transformers.InternVLProcessor)
    hf_proc.start_image_token, hf_proc.end_image_token, hf_proc.image_token = "<img>", "</img>", "<IMG_CONTEXT>"
    hf_proc.image_seq_length = 4
    hf_images = transformers.AutoImageProcessor.from_pretrained(d)
    tiles = []
    for i, line in enumerate(data.read_text().splitlines()[:len(SIZES)]):
        rec = json.loads(line)
        ids, mask, (pixels, sizes) = encode(proc, rec, data.parent, f"row {i}")
        img = Image.open(data.parent / f"img{i}.png").convert("RGB")
        user = rec["messages"][0]["content"]
        text = proc.tokenizer.apply_chat_template([{"role": "user", "content": user}, rec["messages"][1]],
                                                  chat_template=proc.chat_template, tokenize=False)
        want = hf_images([img], crop_to_patches=True, return_tensors="pt")
        expanded = text.replace("<IMG_CONTEXT>", hf_proc.replace_image_token(want, 0))
        assert ids == proc.tokenizer(expanded, add_special_tokens=False)["input_ids"], i
        torch.testing.assert_close(pixels, want["pixel_values"].float())
        assert sizes.tolist() == [[16, 16]] * len(pixels)
        assert [m for t, m in zip(ids, mask) if t == CONTEXT] == [0] * 4 * len(pixels)
        assert all(m == 1 for t, m in zip(ids, mask) if t != CONTEXT)
        tiles.append(len(pixels))
    assert max(tiles) > 1 and min(tiles) == 1                  # tiled (and a thumbnail), and whole


def test_loader_entries_and_cli_first_loss_equal_transformers(files, tmp_path):
    d, data = files
    step = cli_first_step(write_train_yaml(tmp_path, d, data, 96, dp_shard_size=2))
    rows = step.train.images.rows
    assert sum(r is not None for r in rows) == len(SIZES) and rows[len(SIZES)] is None
    model = transformers.InternVLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    want = hf_loss(model, step.batch, pixel_values=torch.cat([p for p, _ in step.images]))
    assert_first_loss_equals(step, want, CONTEXT)


def test_a_processor_of_another_layout_is_refused_by_name(files, tmp_path):
    d, data = files
    import shutil

    from functional_pp.app.inputs import image_settings
    (tmp_path / "m").mkdir()
    for f in d.iterdir():
        shutil.copy(f, tmp_path / "m" / f.name)
    (tmp_path / "m" / "processor_config.json").write_text(json.dumps({"processor_class": "InternVLProcessor",
                                                                       "image_seq_length": 16}))
    cfg = TrainConfig.from_yaml(write_train_yaml(tmp_path, tmp_path / "m", data, 96))
    with pytest.raises(ValueError, match="16-pixel tiles of 16 image tokens \\(image_seq_length\\) with image token "
                                         "id 261, its model 16-pixel tiles \\(image_size\\) of 4"):
        image_settings(cfg)
