"""Gemma 4's image chat data (``processor_type`` with a ``Gemma4Processor``: its image processor,
PIL backend, each image its begin token, one image token per soft token and its end token;
data/vision_chat.py): rows encoded as transformers' ``Gemma4Processor`` encodes them (the same
ids; its patches put back into pixels that data/images.py cuts into the same patches), the padding
and image tokens masked, and ``functional-pp train`` of a tiny Gemma 4 on two simulated devices
whose first loss equals transformers' ``Gemma4ForConditionalGeneration`` on the loader's first batch."""
import json

import pytest
import torch
from chat_tokenizer import GEMMA4_IMAGE_TOKENS, make_tokenizer, write_gemma4_processor_files
from image_chat import (DECODER_LORA, assert_first_loss_equals, cli_first_step, hf_loss, random_sizes,
                        write_image_rows, write_train_yaml)
from vision_harness import flat_patches

from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
    pytest.skip("transformers without Gemma 4", allow_module_level=True)

P, K = 4, 2                                       # patch side, pooling kernel


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4_chat")
    d = root / "model"
    tok = make_tokenizer(d, "<bos>", "<turn|>", extra=GEMMA4_IMAGE_TOKENS)
    write_gemma4_processor_files(d, patch=P, pool=K, max_soft_tokens=70)
    ids = [tok.tok.token_to_id(t) for t in GEMMA4_IMAGE_TOKENS]
    vocab = tok.tok.get_vocab_size()
    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=8,
                hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
                bos_token_id=None, eos_token_id=None, max_position_embeddings=256)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=P, pooling_kernel_size=K, position_embedding_size=64)
    torch.manual_seed(0)
    conf = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=ids[0],
                                     boi_token_id=ids[1], eoi_token_id=ids[2], video_token_id=None,
                                     audio_token_id=None, boa_token_id=None, eoa_token_index=None)
    transformers.Gemma4ForConditionalGeneration(conf).save_pretrained(d)
    data = write_image_rows(root / "data", random_sizes(6, 30), count=8, question="{i}?", answer="pic {i}",
                            image_first=lambda i: True, without_image=False)
    return d, data, ids


def hf_images(rows):
    """transformers' image inputs of the images of ``rows`` (each its images (n, C, H, W; padded) and
    their sizes): each image's patches as rows of (y, x, channel) pixels and their (x, y) positions,
    padded with -1 to the most patches."""
    return flat_patches([im[:, :h, :w] for pixels, sizes in rows for im, (h, w) in zip(pixels, sizes.tolist())], P)


def test_rows_are_encoded_as_the_gemma4_processor_encodes_them(files):
    d, data, (image, boi, eoi) = files
    proc = load_processor(d)
    assert (proc.layout, proc.patch, proc.merge) == ("gemma4", P * K, K)
    rec = json.loads(data.read_text().splitlines()[0])
    ids, mask, (pixels, sizes) = encode(proc, rec, data.parent, "row 0")
    img = Image.open(data.parent / "img0.png").convert("RGB")
    want = proc.image_processor([img], return_tensors="pt")
    n = int(want["num_soft_tokens_per_image"][0])
    at = ids.index(boi)
    assert ids[at:at + n + 2] == [boi] + [image] * n + [eoi] and ids.count(image) == n
    # the processor's patches, put back into pixels, cut again as transformers' model reads them
    rows, positions = hf_images([(pixels, sizes)])
    real = int((want["image_position_ids"][0] >= 0).all(-1).sum())          # (its rows: the real patches first)
    assert rows.shape[1] == real and 0 < real < want["pixel_values"].shape[1]
    torch.testing.assert_close(rows[0], want["pixel_values"][0, :real].float(), rtol=0, atol=0)
    assert torch.equal(positions[0], want["image_position_ids"][0, :real])
    # transformers' Gemma4Processor's expansion of the template's image token (its processor needs torchvision)
    from types import SimpleNamespace
    names = SimpleNamespace(**dict(zip(("image_token", "boi_token", "eoi_token"), GEMMA4_IMAGE_TOKENS)))
    expanded = transformers.Gemma4Processor.replace_image_token(names, want, 0)
    text = proc.tokenizer.apply_chat_template(_messages(rec), chat_template=proc.chat_template, tokenize=False)
    assert text.count(GEMMA4_IMAGE_TOKENS[0]) == 1
    want_ids = proc.tokenizer(text.replace(GEMMA4_IMAGE_TOKENS[0], expanded), add_special_tokens=False)["input_ids"]
    assert want_ids == ids
    # the padding and the image's three tokens masked, every other token trained
    assert all(m == (i not in (image, boi, eoi, 0)) for i, m in zip(ids, mask))


def _messages(rec):
    return [{"role": t["role"], "content": [c if c["type"] != "image" else {"type": "image"} for c in t["content"]]}
            for t in rec["messages"]]


def test_cli_first_loss_equals_transformers(files, tmp_path):
    """Two simulated FSDP devices through ``functional-pp train`` (``chat_template: gemma4_unified``,
    LoRA on the text decoder): the first step's loss (LoRA's B starts at zero) equals transformers' on
    the loader's first global batch."""
    d, data, (image, _, _) = files
    path = write_train_yaml(tmp_path, d, data, 128, chat_template="gemma4_unified", dp_shard_size=2, **DECODER_LORA)
    step = cli_first_step(path)
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    pixels, positions = hf_images(step.images)
    assert_first_loss_equals(step, hf_loss(model, step.batch, pixel_values=pixels, image_position_ids=positions), image)
