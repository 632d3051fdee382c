"""Gemma 4 unified's image chat data (``processor_type`` with a ``Gemma4UnifiedProcessor``; its image
processor is torchvision-only, so where torchvision is missing Gemma 4's PIL one reads the same
``preprocessor_config.json``; data/vision_chat.py): the ids the processor's expansion makes, the
pixels that transformers' own ``patches_merge`` makes into the unified model's rows, the padding and
image tokens masked, audio refused by name, and ``functional-pp train`` of a tiny Gemma 4 unified on
two simulated devices whose first loss equals transformers' ``Gemma4UnifiedForConditionalGeneration``
(its bidirectional image attention from ``mm_token_type_ids``) on the loader's first batch."""
import importlib
import json
import sys
import types

import pytest
import torch
from chat_tokenizer import GEMMA4_IMAGE_TOKENS, make_tokenizer, write_gemma4_processor_files
from image_chat import (DECODER_LORA, assert_first_loss_equals, cli_first_step, hf_loss, random_sizes,
                        write_image_rows, write_train_yaml)
from vision_harness import flat_patches

from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
if not hasattr(transformers, "Gemma4UnifiedForConditionalGeneration"):
    pytest.skip("transformers without Gemma 4 unified", allow_module_level=True)

P, K = 4, 2                                       # patch side, pooling kernel


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4_unified_chat")
    d = root / "model"
    tok = make_tokenizer(d, "<bos>", "<turn|>", extra=GEMMA4_IMAGE_TOKENS)
    write_gemma4_processor_files(d, patch=P, pool=K, max_soft_tokens=70, unified=True)
    ids = [tok.tok.token_to_id(t) for t in GEMMA4_IMAGE_TOKENS]
    text = dict(vocab_size=tok.tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=None,
                eos_token_id=None, max_position_embeddings=256)
    vision = dict(patch_size=P, pooling_kernel_size=K, mm_embed_dim=16, mm_posemb_size=64, output_proj_dims=16)
    torch.manual_seed(0)
    conf = transformers.Gemma4UnifiedConfig(text_config=text, vision_config=vision, audio_config=None,
                                            image_token_id=ids[0], boi_token_id=ids[1], eoi_token_id=ids[2],
                                            video_token_id=None, audio_token_id=None, boa_token_id=None,
                                            eoa_token_index=None)
    transformers.Gemma4UnifiedForConditionalGeneration(conf).save_pretrained(d)
    data = write_image_rows(root / "data", random_sizes(8, 40), count=8, question="{i}?", answer="pic {i}",
                            image_first=lambda i: True, without_image=False)
    return d, data, ids


def unified_rows(rows):
    """transformers' unified inputs of the images of ``rows`` (each its images (n, C, H, W; padded) and
    their sizes): each image's model patches (``K * P`` a side) as rows of (y, x, channel) pixels, row
    by row, and their (x, y) positions, padded with -1 to the most."""
    return flat_patches([im[:, :h, :w] for pixels, sizes in rows for im, (h, w) in zip(pixels, sizes.tolist())],
                        K * P)


def patches_merge():
    """transformers' own ``patches_merge`` (image_processing_gemma4_unified.py, pure torch); the module
    imports torchvision at its top for its resize only, so without torchvision it is imported beside
    a placeholder module, removed afterwards."""
    name = "transformers.models.gemma4_unified.image_processing_gemma4_unified"
    if importlib.util.find_spec("torchvision") is not None:
        return importlib.import_module(name).patches_merge
    stubs = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
    for s in stubs:
        sys.modules[s] = types.ModuleType(s)
    functional = sys.modules["torchvision.transforms.v2"].functional = types.ModuleType("functional")
    functional.InterpolationMode = object            # (read by an annotation only)
    try:
        return importlib.import_module(name).patches_merge
    finally:
        for s in stubs:
            sys.modules.pop(s, None)
        sys.modules.pop(name, None)


def test_rows_are_encoded_as_the_unified_processor_encodes_them(files):
    d, data, (image, boi, eoi) = files
    proc = load_processor(d)
    assert (proc.layout, proc.patch, proc.merge) == ("gemma4", P * K, K)
    rec = json.loads(data.read_text().splitlines()[0])
    ids, mask, (pixels, sizes) = encode(proc, rec, data.parent, "row 0")
    img = Image.open(data.parent / "img0.png").convert("RGB")
    want = proc.image_processor([img], return_tensors="pt")          # (the same resize and rescale)
    n = int(want["num_soft_tokens_per_image"][0])
    at = ids.index(boi)
    assert ids[at:at + n + 2] == [boi] + [image] * n + [eoi] and ids.count(image) == n
    # the unified processor's rows: transformers' patches_merge of the patches, against our pixels cut so
    real = int((want["image_position_ids"][0] >= 0).all(-1).sum())
    merged, merged_pos = patches_merge()(want["pixel_values"][:, :real].float(), want["image_position_ids"][:, :real], n)
    rows, positions = unified_rows([(pixels, sizes)])
    assert rows.shape[1] == n > 1
    torch.testing.assert_close(rows[0], merged[0], rtol=0, atol=0)
    assert torch.equal(positions[0], merged_pos[0])
    from types import SimpleNamespace
    names = SimpleNamespace(**dict(zip(("image_token", "boi_token", "eoi_token"), GEMMA4_IMAGE_TOKENS)))
    expanded = transformers.Gemma4UnifiedProcessor.replace_image_token(names, want, 0)
    text = proc.tokenizer.apply_chat_template(_messages(rec), chat_template=proc.chat_template, tokenize=False)
    want_ids = proc.tokenizer(text.replace(GEMMA4_IMAGE_TOKENS[0], expanded), add_special_tokens=False)["input_ids"]
    assert want_ids == ids
    assert all(m == (i not in (image, boi, eoi, 0)) for i, m in zip(ids, mask))
    with pytest.raises(ValueError, match=r"audio inputs \(audio\) are not supported"):
        encode(proc, {**rec, "audio": ["a.wav"]}, data.parent, "row 0")


def _messages(rec):
    return [{"role": t["role"], "content": [c if c["type"] != "image" else {"type": "image"} for c in t["content"]]}
            for t in rec["messages"]]


def test_cli_first_loss_equals_transformers(files, tmp_path):
    """Two simulated FSDP devices through ``functional-pp train`` (``chat_template: gemma4_unified``, LoRA
    with the example's regex): the first loss (LoRA's B starts at zero) equals transformers' on the loader's
    first global batch, its image tokens attending to each other (``mm_token_type_ids``)."""
    d, data, (image, _, _) = files
    path = write_train_yaml(tmp_path, d, data, 128, chat_template="gemma4_unified", dp_shard_size=2, **DECODER_LORA)
    step = cli_first_step(path)
    assert step.vision["groups"]
    model = transformers.Gemma4UnifiedForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    pixels, positions = unified_rows(step.images)
    tokens = step.batch["tokens"]
    want = hf_loss(model, step.batch, pixel_values=pixels, image_position_ids=positions,
                   mm_token_type_ids=(tokens == image).int())
    causal = hf_loss(model, step.batch, pixel_values=pixels, image_position_ids=positions)
    assert_first_loss_equals(step, want, image)
    assert 1e-5 * abs(want.item()) < abs(causal.item() - want.item())
