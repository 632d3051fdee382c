"""Chat rows with images for GLM-4V (``processor_type: AutoProcessor`` with ``Glm4vProcessor``:
data/vision_chat.py's Qwen layout, ``<|image|>`` its image token; data/qwen_images.py with the bicubic
position taps): the rows' tokens, pixels and grids equal transformers' ``Glm4vProcessor`` on the same
files, labels mask the image token, its markers and the padding (Axolotl's GLM-4V strategy); the
first loss of ``functional-pp train`` on two simulated FSDP devices equals transformers'
``Glm4vForConditionalGeneration`` on the loader's first batch."""
import json

import numpy as np
import pytest
import torch
import yaml
from chat_tokenizer import GLM4V_TEMPLATE, make_glm4v_processor

from functional_pp.config import TrainConfig
from functional_pp.data import DataLoader
from functional_pp.data.formats import build_streams
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


class _Processor(transformers.Glm4vProcessor):
    """transformers' ``Glm4vProcessor`` without its video processor's class check (its video
    processor needs torchvision, which images do not)."""

    def check_argument_for_proper_class(self, name, arg):
        return None


def train_yaml(tmp_path, d, data, **extra):
    cfg = {"base_model": str(d), "processor_type": "AutoProcessor", "sample_packing": False,
           "skip_prepare_dataset": True, "remove_unused_columns": False,
           "datasets": [{"path": str(data), "type": "chat_template"}], "micro_batch_size": 2, "sequence_len": 96,
           "learning_rate": 1e-3, "max_steps": 1, "logging": {"log_every": 1, "plot": False}, **extra}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


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
    from functional_pp import cli
    from functional_pp.app.inputs import image_settings, load_tokenizer
    cfg = TrainConfig.from_yaml(train_yaml(tmp_path, d, data, dp_shard_size=2))
    vision = image_settings(cfg)
    assert vision["qwen"]["resample"] == "bicubic"
    train, _ = build_streams(cfg.datasets, load_tokenizer(cfg), seq_len=96, sample_packing=False, vision=vision)
    assert sum(r is not None for r in train.images.rows) == 8 and train.images.rows[8] is None
    loader = DataLoader(train, global_batch_size=4, seq_len=96, seed=cfg.seed)
    batch = loader.global_batch(0)
    rows = (loader.window_starts(0) // 96).tolist()
    out = tmp_path / "run"
    assert cli.main(["train", str(tmp_path / "train.yaml"), "--simulate", "2", "--output", str(out)]) == 0
    got = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    model = transformers.Glm4vForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    have = [train.images.rows[r] for r in rows if train.images.rows[r] is not None]
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], pixel_values=torch.cat([p for p, _ in have]),
                       image_grid_thw=torch.cat([g for _, g in have]),
                       mm_token_type_ids=(batch["tokens"] == IMAGE).int()).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    assert (batch["labels"] == IMAGE).sum() == 0 and (batch["tokens"] == IMAGE).sum() > 0
    assert abs(got - want.item()) < 1e-5 * abs(want.item())
