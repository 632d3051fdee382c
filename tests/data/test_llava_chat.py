"""LLaVA-1.5's image chat data (``processor_type`` with a ``LlavaProcessor``: CLIP's image processor,
``<image>`` expanded into one token per patch, plus the class token's with
``vision_feature_select_strategy: full``; data/vision_chat.py): rows encoded as Axolotl's base
processing strategy encodes them (the pad and image tokens masked), ``chat_template: llava``, and
``functional-pp train`` of a tiny LLaVA-1.5 on two simulated devices whose first loss equals
transformers' ``LlavaForConditionalGeneration`` on the loader's first batch."""
import json

import pytest
import torch
from chat_tokenizer import make_llava_processor
from image_chat import (DECODER_LORA, assert_first_loss_equals, cli_first_step, hf_loss, random_sizes,
                        write_image_rows, write_train_yaml)

from functional_pp.config import TrainConfig
from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

TEXT = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=272, bos_token_id=256, eos_token_id=257)
VISION = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, image_size=8, patch_size=4, hidden_act="quick_gelu")
IMG = 258


def make(root, strategy):
    d = root / f"model_{strategy}"
    torch.manual_seed(0)
    conf = transformers.LlavaConfig(text_config=TEXT, vision_config=VISION, image_token_index=IMG,
                                    vision_feature_layer=-2, vision_feature_select_strategy=strategy,
                                    initializer_range=0.2)
    transformers.LlavaForConditionalGeneration(conf).save_pretrained(d)
    make_llava_processor(d, strategy=strategy)
    return d


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    data = write_image_rows(root / "data", random_sizes(6, 30), count=8, image_first=lambda i: False,
                            without_image=False)
    return {s: make(root, s) for s in ("default", "full")}, data


def train_yaml(tmp_path, d, data, **extra):
    return write_train_yaml(tmp_path, d, data, 64, chat_template="llava", **DECODER_LORA, **extra)


@pytest.mark.parametrize("strategy, tokens", [("default", 4), ("full", 5)])
def test_rows_are_encoded_as_the_llava_processor_and_axolotl_encode_them(files, strategy, tokens):
    models, data = files
    proc = load_processor(models[strategy])
    rec = json.loads(data.read_text().splitlines()[0])
    ids, mask, (pixels, sizes) = encode(proc, rec, data.parent, "row 0")
    assert tuple(pixels.shape) == (1, 3, 8, 8) and sizes.tolist() == [[8, 8]]    # resized, centre-cropped
    assert ids.count(IMG) == tokens                  # (8 / 4)^2 patches, + the class token's with full
    # transformers' own LlavaProcessor on the same text and image: the same ids and pixels
    hf = transformers.LlavaProcessor(image_processor=proc.image_processor, tokenizer=proc.tokenizer,
                                     patch_size=4, vision_feature_select_strategy=strategy,
                                     num_additional_image_tokens=1, chat_template=proc.chat_template)
    img = Image.open(data.parent / "img0.png").convert("RGB")
    text = proc.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "what is 0?"}, {"type": "image"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "a picture 0"}]}],
        chat_template=proc.chat_template, tokenize=False)
    want = hf(text=text, images=[img], return_tensors="pt", add_special_tokens=False)
    assert want["input_ids"][0].tolist() == ids
    torch.testing.assert_close(want["pixel_values"], pixels, rtol=0, atol=0)
    # Axolotl's base strategy (chat_template llava): the pad and image tokens masked, every other token trained
    assert [m for i, m in zip(ids, mask) if i == IMG] == [0] * tokens
    assert all(m == 1 for i, m in zip(ids, mask) if i != IMG)


def test_cli_first_loss_equals_transformers(files, tmp_path):
    """Two simulated FSDP devices through ``functional-pp train`` (``chat_template: llava``,
    ``vision_feature_select_strategy: default``, ``vision_feature_layer: -2``): the first step's
    loss (LoRA's B starts at zero) equals transformers' on the loader's first global batch."""
    models, data = files
    d = models["default"]
    step = cli_first_step(train_yaml(tmp_path, d, data, dp_shard_size=2))
    assert (step.vision["class_token"], step.vision["image_size"]) == ("dropped", 8)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    want = hf_loss(model, step.batch, pixel_values=torch.cat([p for p, _ in step.images]))
    assert_first_loss_equals(step, want, IMG)
    assert (step.batch["tokens"] == IMG).sum() == 16


def test_a_processor_that_disagrees_with_its_model_is_refused(files, tmp_path):
    models, data = files
    from functional_pp.app.inputs import image_settings
    d = models["full"]
    make_llava_processor(d, strategy="default")          # the processor drops the class token, the model keeps it
    with pytest.raises(ValueError, match="writes 0 image tokens beyond the patches, its model's CLIP tower gives 1"):
        image_settings(TrainConfig.from_yaml(train_yaml(tmp_path, d, data)))
