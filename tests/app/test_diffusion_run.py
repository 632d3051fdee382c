"""``diffusion:`` (Axolotl's DiffusionPlugin) in a config: a run trains the masked-diffusion
objective (models/diffusion_lm.py), says at start-up what does not change training, resumes
bit-exactly (the masks of a step are those of the uninterrupted run), and bad settings are refused
by name before any work."""
import io

import numpy as np
import pytest

from functional_pp import checkpoint as ck
from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.core.tree import leaves_with_paths

PLUGIN = "axolotl.integrations.diffusion.DiffusionPlugin"
BASE = {"dp_shard_size": 2, "micro_batch_size": 2, "sequence_len": 16, "learning_rate": 3e-3, "max_steps": 4,
        "model": "tiny", "data": {"max_bytes": 50_000}, "logging": {"log_every": 1}, "gradient_accumulation_steps": 2,
        "plugins": [PLUGIN], "diffusion": {"mask_token_id": 255, "eps": "1e-3", "generation_interval": 250},
        "checkpoint": {"save_every": 2}}


def config(out, **kw):
    return TrainConfig.from_dict({**BASE, **kw, "logging": {**BASE["logging"], "output_dir": str(out)}}, name="t")


def params_at(out, step):
    return {p: x for p, x in leaves_with_paths(ck.load_checkpoint(out / "checkpoints", step=step,
                                                                  keys=["params"]).tree["params"])}


def test_diffusion_run_trains_and_resumes_bit_exactly(tmp_path):
    full, split, causal = tmp_path / "full", tmp_path / "split", tmp_path / "causal"
    text = io.StringIO()
    train(config(full), stream=text)
    assert "diffusion: generation_interval (no samples are generated during training)" in text.getvalue()
    train(config(split), stop_after=2, stream=io.StringIO())
    second = train(config(split), resume=True, stream=io.StringIO())
    assert second.start_step == 2 and second.final_step == 4
    loss = [[m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m] for out in (full, split)]
    assert loss[0] == loss[1] and len(loss[0]) == 4
    first = next(m for m in read_metrics(full / "metrics.jsonl") if "loss" in m)
    assert 0 < first["diffusion_mask_ratio"] < 1 and first["diffusion_masked_tokens"] >= 1, first
    a, b = params_at(full, 4), params_at(split, 4)
    assert all(np.array_equal(a[p].numpy(), b[p].numpy()) for p in a)
    # the objective is not the causal loss
    plain = {k: v for k, v in BASE.items() if k not in ("plugins", "diffusion")}
    train(TrainConfig.from_dict({**plain, "logging": {"log_every": 1, "output_dir": str(causal)}}, name="t"),
          stream=io.StringIO())
    assert [m["loss"] for m in read_metrics(causal / "metrics.jsonl") if "loss" in m][0] != loss[0][0]


@pytest.mark.parametrize("change, message", [
    ({"diffusion": {"mask_token_id": 5, "min_mask_ratio": 0.9, "max_mask_ratio": 0.1}},
     r"diffusion.min_mask_ratio \(0.9\) must be <= max_mask_ratio \(0.1\)"),
    ({"diffusion": {"mask_token_id": 5, "noise_level": 1}}, r"diffusion.noise_level is not an option of diffusion"),
    ({"diffusion": None}, r"diffusion.mask_token_id is not set"),           # the plugin alone: Axolotl's defaults
    ({"rl": "dpo"}, r"diffusion with rl: dpo is not supported"),
    ({"torch_compile": True}, r"diffusion with torch_compile is not supported"),
    ({"pp_size": 2}, r"diffusion with pp_size > 1 is not supported yet"),
    ({"plugins": [PLUGIN, "axolotl.integrations.foo.FooPlugin"]}, r"plugins: 'axolotl.integrations.foo.FooPlugin'"),
])
def test_bad_diffusion_settings_are_refused_by_name(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, **change)


def test_mask_token_outside_the_vocabulary_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"diffusion.mask_token_id 256 is outside the model's vocabulary of 256 "
                                          r"tokens \(ids 0..255\)"):
        train(config(tmp_path / "o", diffusion={"mask_token_id": 256}), stream=io.StringIO())
    assert not (tmp_path / "o").exists()
