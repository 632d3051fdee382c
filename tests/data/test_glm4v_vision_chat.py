"""Chat rows with images for GLM-4V (``processor_type: AutoProcessor`` with ``Glm4vProcessor``:
data/vision_chat.py's Qwen layout, ``<|image|>`` its image token; data/qwen_images.py with the bicubic
position taps): the rows' tokens, pixels and grids equal transformers' ``Glm4vProcessor`` on the same
files, labels mask the image token, its markers and the padding (Axolotl's GLM-4V strategy); the
first loss of ``functional-pp train`` on two simulated FSDP devices equals transformers'
``Glm4vForConditionalGeneration`` on the loader's first batch."""
import json

import pytest
import torch
from chat_tokenizer import GLM4V_TEMPLATE, make_glm4v_processor
from image_chat import (assert_first_loss_equals, cli_first_step, hf_loss, random_sizes, write_image_rows,
                        write_train_yaml)

from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
if not hasattr(transformers, "Glm4vForConditionalGeneration"):
    pytest.skip("transformers without GLM-4V", allow_module_level=True)

EOS, BEGIN, IMAGE, END = 256, 261, 262, 263           # <|endoftext|>, <|begin_of_image|>, <|image|>, <|end_of_image|>
TEXT = dict(vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, initializer_range=0.2, pad_token_id=None, eos_token_id=EOS,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[2, 1, 1]))
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=4,
              image_size=12, temporal_patch_size=2, spatial_merge_size=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4v_vlm")
    d = root / "model"
    torch.manual_seed(0)
    conf = transformers.Glm4vConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                                    video_token_id=264, image_start_token_id=BEGIN, image_end_token_id=END)
    transformers.Glm4vForConditionalGeneration(conf).save_pretrained(d)
    make_glm4v_processor(d)
    data = write_image_rows(root / "data", random_sizes(8, 30, first=(20, 13)), count=8)
    return d, data


class _Processor(transformers.Glm4vProcessor):
    """transformers' ``Glm4vProcessor`` without its video processor's class check (its video
    processor needs torchvision, which images do not)."""

    def check_argument_for_proper_class(self, name, arg):
        return None


def test_rows_equal_transformers_processor_and_labels_mask_the_markers(files):
    d, data = files
    proc = load_processor(d)
    rec = json.loads(data.read_text().splitlines()[0])
    ids, mask, (pixels, grids) = encode(proc, rec, data.parent, "row 0")
    hf = _Processor(image_processor=transformers.AutoImageProcessor.from_pretrained(str(d)),
                                     tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(str(d)),
                                     chat_template=GLM4V_TEMPLATE)
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is 0?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "a picture 0"}]}]
    text = hf.apply_chat_template(turns, tokenize=False)
    want = hf(text=[text], images=[Image.open(data.parent / "img0.png").convert("RGB")], return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    torch.testing.assert_close(grids, want["image_grid_thw"], rtol=0, atol=0)
    torch.testing.assert_close(pixels, want["pixel_values"].float(), rtol=0, atol=0)
    assert grids.tolist() == [[1, 4, 4]] and ids.count(IMAGE) == 4     # one <|image|> per merged 2 x 2 patches
    assert (torch.tensor(ids) == IMAGE).int().tolist() == want["mm_token_type_ids"][0].tolist()
    first = ids.index(IMAGE)
    assert ids[first - 1:first + 5] == [BEGIN] + [IMAGE] * 4 + [END]
    assert all(m == (i not in (BEGIN, IMAGE, END, EOS)) for i, m in zip(ids, mask))    # (no roles masked)


def test_loader_entries_and_cli_first_loss_equal_transformers(files, tmp_path):
    d, data = files
    step = cli_first_step(write_train_yaml(tmp_path, d, data, 96, dp_shard_size=2))
    assert step.vision["qwen"]["resample"] == "bicubic"
    assert sum(r is not None for r in step.train.images.rows) == 8 and step.train.images.rows[8] is None
    model = transformers.Glm4vForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    want = hf_loss(model, step.batch, pixel_values=torch.cat([p for p, _ in step.images]),
                   image_grid_thw=torch.cat([g for _, g in step.images]),
                   mm_token_type_ids=(step.batch["tokens"] == IMAGE).int())
    assert_first_loss_equals(step, want, IMAGE)


