"""Chat rows with images for PaddleOCR-VL (``processor_type: AutoProcessor`` with its
``PaddleOCRVLProcessor``: data/vision_chat.py's Qwen layout, its image processor on PIL): each
``<|IMAGE_PLACEHOLDER|>`` expanded into one per merged patch, labels masking it (Axolotl's chat_template
strategy with a processor), the raster-ordered patches put in merge order; the first loss of
``functional-pp train`` with ``full_finetune: true`` on two simulated FSDP devices equals transformers'
``PaddleOCRVLForConditionalGeneration`` on the loader's first batch."""
import json

import numpy as np
import pytest
import torch
import yaml
from chat_tokenizer import make_paddleocr_vl_processor

from functional_pp.config import TrainConfig
from functional_pp.data import DataLoader
from functional_pp.data.formats import build_streams
from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
if not hasattr(transformers, "PaddleOCRVLForConditionalGeneration"):
    pytest.skip("transformers without PaddleOCR-VL", allow_module_level=True)

START, PAD, END = 257, 258, 259          # <|IMAGE_START|>, <|IMAGE_PLACEHOLDER|>, <|IMAGE_END|>
TEXT = dict(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, use_bias=True, pad_token_id=None, bos_token_id=None, eos_token_id=256,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]))
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
              spatial_merge_size=2, image_size=12)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("paddleocr_vlm")
    d = root / "model"
    torch.manual_seed(0)
    conf = transformers.PaddleOCRVLConfig(text_config=TEXT, vision_config=VISION, image_token_id=PAD)
    model = transformers.PaddleOCRVLForConditionalGeneration(conf)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.ndim == 1 or "norm" in n else p.normal_(0, 0.2)
    model.save_pretrained(d)
    make_paddleocr_vl_processor(d)
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        h, w = (20, 13) if i == 0 else (int(rng.integers(8, 30)), int(rng.integers(8, 30)))
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(data / f"img{i}.png")
        user = [{"type": "text", "text": f"read {i}"}, {"type": "image"}]
        rows.append({"messages": [{"role": "user", "content": user if i % 2 else user[::-1]},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"text {i}"}]}],
                     "images": [f"img{i}.png"]})
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return d, data / "train.jsonl"


def test_rows_are_encoded_as_the_processor_expands_them(files):
    d, data = files
    proc = load_processor(d)
    rec = json.loads(data.read_text().splitlines()[0])
    ids, mask, (pixels, grids) = encode(proc, rec, data.parent, "row 0")
    want = transformers.PaddleOCRVLImageProcessorPil.from_pretrained(str(d))(
        [Image.open(data.parent / "img0.png").convert("RGB")], return_tensors="pt")
    assert grids.tolist() == want["image_grid_thw"].tolist() == [[1, 4, 4]]
    torch.testing.assert_close(pixels, want["pixel_values"], rtol=0, atol=0)
    first = ids.index(PAD)
    assert ids[first - 1:first + 5] == [START] + [PAD] * 4 + [END]      # one per merged 2 x 2 patches
    assert [m for i, m in zip(ids, mask) if i == PAD] == [0] * 4


def test_cli_full_finetune_first_loss_equals_transformers(files, tmp_path):
    d, data = files
    from functional_pp import cli
    from functional_pp.app.inputs import image_settings, load_tokenizer
    cfg = {"base_model": str(d), "processor_type": "AutoProcessor", "sample_packing": False, "full_finetune": True,
           "skip_prepare_dataset": True, "remove_unused_columns": False,
           "datasets": [{"path": str(data), "type": "chat_template"}], "micro_batch_size": 2, "sequence_len": 64,
           "learning_rate": 1e-3, "max_steps": 1, "dp_shard_size": 2, "logging": {"log_every": 1, "plot": False}}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
    cfg = TrainConfig.from_yaml(tmp_path / "train.yaml")
    vision = image_settings(cfg)
    assert vision["qwen"]["raster"] and vision["qwen"]["resample"] == "bilinear_half"
    train, _ = build_streams(cfg.datasets, load_tokenizer(cfg), seq_len=64, sample_packing=False, vision=vision)
    loader = DataLoader(train, global_batch_size=4, seq_len=64, seed=cfg.seed)
    batch = loader.global_batch(0)
    rows = (loader.window_starts(0) // 64).tolist()
    out = tmp_path / "run"
    assert cli.main(["train", str(tmp_path / "train.yaml"), "--simulate", "2", "--output", str(out)]) == 0
    got = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    model = transformers.PaddleOCRVLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    have = [train.images.rows[r] for r in rows if train.images.rows[r] is not None]
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], pixel_values=torch.cat([p for p, _ in have]),
                       image_grid_thw=torch.cat([g for _, g in have]),
                       mm_token_type_ids=(batch["tokens"] == PAD).int()).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    assert (batch["labels"] == PAD).sum() == 0 and (batch["tokens"] == PAD).sum() > 0
    assert abs(got - want.item()) < 1e-5 * abs(want.item())
