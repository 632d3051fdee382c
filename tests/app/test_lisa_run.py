"""``lisa_n_layers`` / ``lisa_step_interval`` / ``lisa_layers_attribute`` (Axolotl's LISA) in a
config: a run trains only the drawn layers (the others end as they started), says so in the
start-up summary, resumes bit-exactly, and bad values are refused before any work."""
import io

import numpy as np
import pytest

from functional_pp import checkpoint as ck
from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.core.tree import leaves_with_paths

BASE = {"dp_shard_size": 2, "micro_batch_size": 2, "sequence_len": 16, "learning_rate": 3e-3, "max_steps": 4,
        "weight_decay": 0.1, "model": "tiny", "data": {"max_bytes": 50_000}, "logging": {"log_every": 1},
        "lisa_n_layers": 1, "lisa_step_interval": 2, "lisa_layers_attribute": "model.layers",
        "checkpoint": {"save_every": 2}}


def config(out, **kw):
    return TrainConfig.from_dict({**BASE, **kw, "logging": {**BASE["logging"], "output_dir": str(out)}}, name="t")


def params_at(out, step):
    return {p: x for p, x in leaves_with_paths(ck.load_checkpoint(out / "checkpoints", step=step,
                                                                  keys=["params"]).tree["params"])}


def test_lisa_trains_the_drawn_layers_and_resumes_bit_exactly(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    text = io.StringIO()
    train(config(full), stream=text)
    assert "LISA: 1 decoder layers trained at a time, drawn every 2 steps" in text.getvalue()
    train(config(split), stop_after=2, stream=io.StringIO())
    second = train(config(split), resume=True, stream=io.StringIO())
    assert second.start_step == 2 and second.final_step == 4
    loss = [[m["loss"] for m in read_metrics(out / "metrics.jsonl")] for out in (full, split)]
    assert loss[0] == loss[1]
    a, b = params_at(full, 4), params_at(split, 4)
    assert all(np.array_equal(a[p].numpy(), b[p].numpy()) for p in a)
    # steps 2-3 train the layer Axolotl draws at step 2 (and the embeddings, norm, head); the other is untouched
    np.random.seed(2)
    chosen = int(np.random.choice(range(2), 1, replace=False)[0])
    before = params_at(full, 2)
    for p, x in a.items():
        moved = not np.array_equal(x.numpy(), before[p].numpy())
        layer = int(p.split(".")[1]) if p.startswith("layers.") else None
        assert moved == (layer is None or layer == chosen), p


@pytest.mark.parametrize("change, message", [
    ({"lisa_step_interval": None}, "lisa_n_layers is set without lisa_step_interval"),
    ({"lisa_n_layers": 0}, "lisa_n_layers must be a whole number >= 1"),
    ({"lisa_layers_attribute": "model.embed_tokens"}, "is not a model's list of decoder layers"),
    ({"adapter": "lora"}, "lisa_n_layers with adapter"),
    ({"optimizer": "sgd"}, "LISA is built on AdamW"),
])
def test_bad_lisa_values_are_refused_by_name(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, **change)


def test_more_layers_than_the_model_has_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="lisa_n_layers: 5 but the model has 2 decoder layers"):
        train(config(tmp_path / "o", lisa_n_layers=5), stream=io.StringIO())
    assert not (tmp_path / "o").exists()
