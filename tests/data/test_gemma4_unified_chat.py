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

import numpy as np
import pytest
import torch
import yaml
from chat_tokenizer import GEMMA4_IMAGE_TOKENS, make_tokenizer, write_gemma4_processor_files

from functional_pp.config import TrainConfig
from functional_pp.data import DataLoader
from functional_pp.data.formats import build_streams
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
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        h, w = int(rng.integers(8, 40)), int(rng.integers(8, 40))
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(data / f"img{i}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{i}?"}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"pic {i}"}]}],
                     "images": [f"img{i}.png"]})
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return d, data / "train.jsonl", ids


def unified_rows(pixels, sizes):
    """transformers' unified inputs of images (n, C, H, W; padded) of ``sizes``: each image's model patches
    (``K * P`` a side) as rows of (y, x, channel) pixels, row by row, and their (x, y) positions, padded
    with -1 to the most."""
    S = K * P
    most = max(int(h) * int(w) // S ** 2 for h, w in sizes.tolist())
    values, positions = [], []
    for im, (h, w) in zip(pixels, sizes.tolist()):
        c = im.shape[0]
        patches = im[:, :h, :w].reshape(c, h // S, S, w // S, S).permute(1, 3, 2, 4, 0).reshape(-1, S * S * c)
        y, x = torch.meshgrid(torch.arange(h // S), torch.arange(w // S), indexing="ij")
        pad = most - len(patches)
        values.append(torch.cat([patches, patches.new_zeros(pad, patches.shape[1])]))
        positions.append(torch.cat([torch.stack([x.reshape(-1), y.reshape(-1)], -1), torch.full((pad, 2), -1)]))
    return torch.stack(values), torch.stack(positions)


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
    rows, positions = unified_rows(pixels, sizes)
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
    from functional_pp import cli
    from functional_pp.app.inputs import image_settings, load_tokenizer
    cfg = {"base_model": str(d), "processor_type": "AutoProcessor", "sample_packing": False,
           "skip_prepare_dataset": True, "remove_unused_columns": False, "chat_template": "gemma4_unified",
           "datasets": [{"path": str(data), "type": "chat_template"}], "micro_batch_size": 2, "sequence_len": 128,
           "learning_rate": 1e-3, "max_steps": 1, "adapter": "lora", "lora_r": 4, "lora_alpha": 8,
           "lora_target_modules": r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj",
           "dp_shard_size": 2, "logging": {"log_every": 1, "plot": False}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    train_cfg = TrainConfig.from_yaml(path)
    vision = image_settings(train_cfg)
    assert vision["groups"]
    train, _ = build_streams(train_cfg.datasets, load_tokenizer(train_cfg), seq_len=128, sample_packing=False,
                             vision=vision)
    loader = DataLoader(train, global_batch_size=4, seq_len=128, seed=train_cfg.seed)
    batch = loader.global_batch(0)
    rows = (loader.window_starts(0) // 128).tolist()
    out = tmp_path / "run"
    assert cli.main(["train", str(path), "--simulate", "2", "--output", str(out)]) == 0
    got = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    model = transformers.Gemma4UnifiedForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    pixels, positions = zip(*(unified_rows(*train.images.rows[r]) for r in rows))
    most = max(p.shape[1] for p in pixels)
    pixels = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, most - p.shape[1])) for p in pixels])
    positions = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, most - p.shape[1]), value=-1) for p in positions])
    tokens = batch["tokens"]
    with torch.no_grad():
        logits = model(input_ids=tokens, pixel_values=pixels, image_position_ids=positions,
                       mm_token_type_ids=(tokens == image).int()).logits
        causal = model(input_ids=tokens, pixel_values=pixels, image_position_ids=positions).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    other = torch.nn.functional.cross_entropy(causal.reshape(-1, causal.shape[-1]), batch["labels"].reshape(-1))
    assert (batch["labels"] == image).sum() == 0 and (tokens == image).sum() > 0
    assert abs(got - want.item()) < 1e-5 * abs(want.item()) < abs(other.item() - want.item())
