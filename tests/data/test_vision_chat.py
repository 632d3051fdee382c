"""Chat data with images (``processor_type``, data/vision_chat.py): rows encoded as Axolotl's
multimodal collator does (the processor's chat template, each image expanded into its tokens,
labels without the image tokens), the loader's image entries, and ``functional-pp train`` of a
tiny Mistral 3 on two simulated devices whose first loss equals transformers' on the same batch;
what cannot carry images yet is refused by name before any work."""
import json

import numpy as np
import pytest
import torch
import yaml
from chat_tokenizer import make_pixtral_processor

from functional_pp.config import ConfigError, TrainConfig, model_config
from functional_pp.data import DataLoader
from functional_pp.data.formats import build_streams
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
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        h, w = (20, 13) if i == 0 else (int(rng.integers(8, 30)), int(rng.integers(8, 30)))
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(data / f"img{i}.png")
        user = [{"type": "text", "text": f"what is {i}?"}, {"type": "image"}]
        rows.append({"messages": [{"role": "user", "content": user if i % 2 else user[::-1]},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"a picture {i}"}]}],
                     "images": [f"img{i}.png"]})
    rows.append({"messages": [{"role": "user", "content": "no image here"},
                              {"role": "assistant", "content": "fine"}]})
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return d, data / "train.jsonl"


def train_yaml(tmp_path, d, data, **extra):
    cfg = {"base_model": str(d), "processor_type": "AutoProcessor", "sample_packing": False,
           "skip_prepare_dataset": True, "remove_unused_columns": False,
           "datasets": [{"path": str(data), "type": "chat_template"}], "micro_batch_size": 2, "sequence_len": 48,
           "learning_rate": 1e-3, "max_steps": 1, "adapter": "lora", "lora_r": 4, "lora_alpha": 8,
           "lora_target_modules": r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj",
           "logging": {"log_every": 1, "plot": False}, **extra}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


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
    from functional_pp import cli
    from functional_pp.app.inputs import image_settings
    cfg = TrainConfig.from_yaml(train_yaml(tmp_path, d, data, dp_shard_size=2))
    vision = image_settings(cfg)
    train, _ = build_streams(cfg.datasets, _tokenizer(cfg), seq_len=48,
                             sample_packing=False, vision=vision)
    assert sum(r is not None for r in train.images.rows) == 8 and train.images.rows[8] is None
    loader = DataLoader(train, global_batch_size=4, seq_len=48, seed=cfg.seed)
    batch = loader.global_batch(0)
    rows = (loader.window_starts(0) // 48).tolist()
    out = tmp_path / "run"
    assert cli.main(["train", str(tmp_path / "train.yaml"), "--simulate", "2", "--output", str(out)]) == 0
    got = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    have = [train.images.rows[r] for r in rows if train.images.rows[r] is not None]
    H = max(p.shape[-2] for p, _ in have)
    W = max(p.shape[-1] for p, _ in have)
    pixels = torch.cat([torch.nn.functional.pad(p, (0, W - p.shape[-1], 0, H - p.shape[-2])) for p, _ in have])
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], pixel_values=pixels,
                       image_sizes=torch.cat([s for _, s in have])).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    assert (batch["labels"] == IMG).sum() == 0 and (batch["tokens"] == IMG).sum() > 0
    assert abs(got - want.item()) < 1e-5 * abs(want.item())


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

