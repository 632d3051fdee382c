"""What the vision-language chat tests share (tests/data/test_*_chat.py): a folder of chat rows with
images, the training config that reads them through the model's processor, and the first loss of
``functional-pp train`` on two simulated FSDP devices beside transformers' on the loader's first batch."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import torch
import yaml

DECODER_LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8,
                "lora_target_modules": r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"}
"""LoRA on the text decoder's linears (Axolotl's vision examples' regex): its B starts at zero, so the
first loss is the base model's."""


def write_image_rows(data: Path, sizes: Sequence[tuple[int, int]] | Callable, count: int | None = None, *,
                     question: str = "what is {i}?", answer: str = "a picture {i}",
                     image_first: Callable[[int], bool] = lambda i: i % 2 == 0, without_image: bool = True) -> Path:
    """``data/train.jsonl``: row ``i`` a user turn of ``question`` and one image (``img{i}.png``, random
    pixels of ``sizes[i]`` or ``sizes(i, rng)`` for ``count`` rows; before the text where
    ``image_first(i)``) and the reply ``answer``; last a row without an image (``without_image``)."""
    from PIL import Image
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count if callable(sizes) else len(sizes)):
        h, w = sizes(i, rng) if callable(sizes) else sizes[i]
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(data / f"img{i}.png")
        user = [{"type": "text", "text": question.format(i=i)}, {"type": "image"}]
        rows.append({"messages": [{"role": "user", "content": user[::-1] if image_first(i) else user},
                                  {"role": "assistant", "content": [{"type": "text", "text": answer.format(i=i)}]}],
                     "images": [f"img{i}.png"]})
    if without_image:
        rows.append({"messages": [{"role": "user", "content": "no image here"},
                                  {"role": "assistant", "content": "fine"}]})
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return data / "train.jsonl"


def random_sizes(low: int, high: int, first: tuple[int, int] | None = None) -> Callable:
    """Image sizes drawn from the rows' generator: height and width in [low, high) (row 0: ``first``)."""
    def size(i, rng):
        return first if i == 0 and first else (int(rng.integers(low, high)), int(rng.integers(low, high)))
    return size


def write_train_yaml(folder: Path, base_model: Path, data: Path, sequence_len: int, **extra) -> Path:
    """``folder/train.yaml``: one step on ``data``'s chat rows, images through ``base_model``'s processor
    (``processor_type: AutoProcessor``), two rows a device, ``extra`` keys over these."""
    cfg = {"base_model": str(base_model), "processor_type": "AutoProcessor", "sample_packing": False,
           "skip_prepare_dataset": True, "remove_unused_columns": False,
           "datasets": [{"path": str(data), "type": "chat_template"}], "micro_batch_size": 2,
           "sequence_len": sequence_len, "learning_rate": 1e-3, "max_steps": 1,
           "logging": {"log_every": 1, "plot": False}, **extra}
    path = folder / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli_first_step(path: Path, tokenizer: Callable | None = None) -> SimpleNamespace:
    """``functional-pp train`` of the config at ``path`` (its ``sequence_len``, two simulated devices):
    its first loss (``loss``), the loader's first global batch of four rows (``batch``), their image
    entries in order (``images``: the rows with images), the stream (``train``) and the image
    settings (``vision``). ``tokenizer(cfg)``: the stream's (default the config's)."""
    from functional_pp import cli
    from functional_pp.app.inputs import image_settings, load_tokenizer
    from functional_pp.config import TrainConfig
    from functional_pp.data import DataLoader
    from functional_pp.data.formats import build_streams
    cfg = TrainConfig.from_yaml(path)
    seq = cfg.sequence_len
    vision = image_settings(cfg)
    train, _ = build_streams(cfg.datasets, (tokenizer or load_tokenizer)(cfg), seq_len=seq, sample_packing=False,
                             vision=vision)
    loader = DataLoader(train, global_batch_size=4, seq_len=seq, seed=cfg.seed)
    batch = loader.global_batch(0)
    rows = (loader.window_starts(0) // seq).tolist()
    out = path.parent / "run"
    assert cli.main(["train", str(path), "--simulate", "2", "--output", str(out)]) == 0
    loss = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    images = [train.images.rows[r] for r in rows if train.images.rows[r] is not None]
    return SimpleNamespace(loss=loss, batch=batch, images=images, train=train, vision=vision)


def hf_loss(model, batch: dict, **inputs) -> torch.Tensor:
    """transformers' ``model``'s mean next-token loss on ``batch`` (its tokens and labels) with ``inputs``."""
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], **inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


def assert_first_loss_equals(step: SimpleNamespace, want: torch.Tensor, image_token: int) -> None:
    """The run's first loss equals transformers' ``want`` (1e-5 relative) on a batch with image tokens,
    none of them trained."""
    batch = step.batch
    assert (batch["labels"] == image_token).sum() == 0 and (batch["tokens"] == image_token).sum() > 0
    assert abs(step.loss - want.item()) < 1e-5 * abs(want.item())
