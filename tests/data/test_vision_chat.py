"""Chat data with images (``processor_type``, data/vision_chat.py): rows encoded as Axolotl's
multimodal collator does (the processor's chat template, each image expanded into its tokens,
labels without the image tokens), the loader's image entries, and ``functional-pp train`` of a
tiny Mistral 3 on two simulated devices whose first loss equals transformers' on the same batch;
what cannot carry images yet is refused by name before any work."""
import json

import pytest
import torch
from chat_tokenizer import make_pixtral_processor
from image_chat import (DECODER_LORA, assert_first_loss_equals, cli_first_step, hf_loss, random_sizes,
                        write_image_rows, write_train_yaml)

from functional_pp.config import ConfigError, TrainConfig, model_config
from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

TEXT = dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=272, bos_token_id=256, eos_token_id=257)
VISION = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=32, patch_size=4)
IMG, BREAK, END = 260, 261, 262


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    d = root / "model"
    torch.manual_seed(0)
    conf = transformers.Mistral3Config(text_config=TEXT, vision_config=VISION, image_token_index=IMG,
                                       spatial_merge_size=2, initializer_range=0.2)
    transformers.Mistral3ForConditionalGeneration(conf).save_pretrained(d)
    make_pixtral_processor(d)
    data = write_image_rows(root / "data", random_sizes(8, 30, first=(20, 13)), count=8)
    return d, data


def train_yaml(tmp_path, d, data, **extra):
    return write_train_yaml(tmp_path, d, data, 48, **DECODER_LORA, **extra)


def test_rows_are_encoded_as_axolotl_encodes_them(files):
    d, data = files
    proc = load_processor(d)
    rec = json.loads(data.read_text().splitlines()[0])
    ids, mask, (pixels, sizes) = encode(proc, rec, data.parent, "row 0")
    assert sizes.tolist() == [[24, 16]]              # 20 x 13 resized by PixtralImageProcessor: multiples of 8
    assert tuple(pixels.shape) == (1, 3, 24, 16)
    # the image first (the bare placeholder's place): rows of 2 image tokens, a break, the last an end
    first = ids.index(IMG)
    assert ids[first:first + 9] == [IMG, IMG, BREAK, IMG, IMG, BREAK, IMG, IMG, END]
    assert ids[first - 1] == proc.tokenizer.convert_tokens_to_ids("[INST]") and ids[0] == 256
    assert [m for i, m in zip(ids, mask) if i in (IMG, BREAK, END)] == [0] * 9     # not trained
    assert all(m == 1 for i, m in zip(ids, mask) if i not in (IMG, BREAK, END))   # every other token (no roles)


def test_loader_entries_and_cli_first_loss_equal_transformers(files, tmp_path):
    """Two simulated FSDP devices through ``functional-pp train``: the first step's loss (LoRA's B
    starts at zero: the base model's) equals transformers' Mistral3ForConditionalGeneration on the
    loader's first global batch, pixels and all."""
    d, data = files
    step = cli_first_step(train_yaml(tmp_path, d, data, dp_shard_size=2), _tokenizer)
    assert sum(r is not None for r in step.train.images.rows) == 8 and step.train.images.rows[8] is None
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    H = max(p.shape[-2] for p, _ in step.images)
    W = max(p.shape[-1] for p, _ in step.images)
    pixels = torch.cat([torch.nn.functional.pad(p, (0, W - p.shape[-1], 0, H - p.shape[-2])) for p, _ in step.images])
    want = hf_loss(model, step.batch, pixel_values=pixels, image_sizes=torch.cat([s for _, s in step.images]))
    assert_first_loss_equals(step, want, IMG)


def _tokenizer(cfg):
    from functional_pp.app.inputs import load_tokenizer
    return load_tokenizer(cfg)


def test_what_cannot_carry_images_is_refused_by_name(files, tmp_path):
    d, data = files
    with pytest.raises(ConfigError, match="sample_packing: true with processor_type: rows with images are not "
                                          "packed"):
        TrainConfig.from_yaml(train_yaml(tmp_path, d, data, sample_packing=True)).validate()
    with pytest.raises(ConfigError, match="pp_size 2 with processor_type: the vision encoder is not placed on "
                                          "pipeline stages yet"):
        TrainConfig.from_yaml(train_yaml(tmp_path, d, data, pp_size=2)).validate()
    gemma = tmp_path / "gemma3"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": dict(
        TEXT, model_type="gemma3_text", head_dim=8), "vision_config": {"model_type": "siglip_vision_model"}}))
    with pytest.raises(ConfigError, match="processor_type: images of model_type 'gemma3' \\(processor_type; vision "
                                          "tower 'siglip_vision_model'\\) are not supported yet"):
        model_config(TrainConfig.from_yaml(train_yaml(tmp_path, gemma, data)))


def test_chat_template_pixtral_trains_the_replies_only(files):
    """``chat_template: pixtral``: Axolotl's template renders the row and its Pixtral strategy trains the
    assistant's reply through its EOS, nothing of the user turn (the image tokens included)."""
    import dataclasses
    from functional_pp.data.chat import template_text
    d, data = files
    proc = dataclasses.replace(load_processor(d), chat_template=template_text("pixtral"), reply_after="[/INST]")
    rec = json.loads(data.read_text().splitlines()[1])
    ids, mask, _ = encode(proc, rec, data.parent, "row 1")
    text = proc.tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert text == "a picture 1</s>"
    assert IMG in ids and ids[-1] == 257

