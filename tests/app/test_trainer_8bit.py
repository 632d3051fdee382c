"""The training loop with an Axolotl 8-bit (or torchao 4-bit) optimizer name: it trains, its
checkpoints hold the low-bit moments, and a resume is bit-exact (docs/quantization.md "8-bit
optimizer state")."""
import io

import pytest
import torch

from functional_pp import checkpoint as ck
from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import TrainConfig

BASE = {"dp_shard_size": 2, "micro_batch_size": 2, "sequence_len": 16, "learning_rate": 3e-3,
        "max_steps": 3, "weight_decay": 0.1, "model": "tiny", "data": {"max_bytes": 50_000},
        "logging": {"log_every": 1}, "optimizer": "paged_adamw_8bit"}


def config(out, optimizer="paged_adamw_8bit"):
    return TrainConfig.from_dict({**BASE, "optimizer": optimizer, "logging": {**BASE["logging"], "output_dir": str(out)}},
                                 name="t")


@pytest.mark.parametrize("optimizer", ["paged_adamw_8bit", "adamw_torch_4bit"])
def test_low_bit_adamw_trains_checkpoints_and_resumes_bit_exactly(tmp_path, optimizer):
    full, split = tmp_path / "full", tmp_path / "split"
    train(config(full, optimizer), stream=io.StringIO())
    train(config(split, optimizer), stop_after=1, stream=io.StringIO())
    second = train(config(split, optimizer), resume=True, stream=io.StringIO())
    assert second.start_step == 1 and second.final_step == 3
    loss = [[m["loss"] for m in read_metrics(out / "metrics.jsonl")] for out in (full, split)]
    assert loss[0] == loss[1]
    saved = ck.load_checkpoint(full / "checkpoints", step=3, keys=["opt"]).tree["opt"]
    codes = [x for x in _leaves(saved) if x.dtype == torch.uint8]
    assert codes, "no 8-bit moments in the checkpoint"
    again = ck.load_checkpoint(split / "checkpoints", step=3, keys=["opt"]).tree["opt"]
    assert all(torch.equal(a, b) for a, b in zip(_leaves(saved), _leaves(again)))


def _leaves(tree):
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return []
