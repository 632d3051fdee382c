"""``reward_model`` / ``process_reward_model`` from an Axolotl-style config, end to end: a tiny Qwen2
trained as a reward model on bradley_terry.chat_template pairs (its loss and metrics past the first
step equal TRL's RewardTrainer on the exported Qwen2ForSequenceClassification) and as a process
reward model on stepwise_supervised rows (its loss equals transformers' Qwen2ForTokenClassification
on the export); runs resume exactly; LoRA trains the score head whole; bad keys are refused first."""
from __future__ import annotations

import collections
import io
import json
import types
from pathlib import Path

import pytest
import torch
from chat_tokenizer import make_tokenizer

from functional_pp.app.export import export_run
from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.data.pair_loader import PairLoader

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

KW = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
          max_position_embeddings=128)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-qwen2")
    tok = make_tokenizer(d, None, "<|im_end|>")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=tok.vocab_size, **KW, eos_token_id=tok.eos_id,
                                                           tie_word_embeddings=True)).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("reward-data")
    with open(d / "pairs.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"system": "Be brief." if i % 3 == 0 else "", "input": f"What is {i} plus {i}?",
                                "chosen": f"It is {2 * i}.", "rejected": "No idea." * (1 + i % 2),
                                **({"margin": 0.5 * (i % 4)} if i % 2 else {})}) + "\n")
    with open(d / "steps.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"Add {i} and {i}, then 1.", "completions": [
                f"{i} + {i} = {2 * i}", f"{2 * i} + 1 = {2 * i + i % 3}"], "labels": [True, i % 3 == 1]}) + "\n")
    return d / "pairs.jsonl", d / "steps.jsonl"


def config(base: Path, path: Path, out: Path, kind: str = "reward_model", **over) -> TrainConfig:
    entry = {"path": str(path), "type": "bradley_terry.chat_template" if kind == "reward_model"
             else "stepwise_supervised"}
    if kind == "process_reward_model":
        entry.update(step_separator="\n")
    d = {"base_model": str(base), kind: True, "chat_template": "qwen_25", "datasets": [entry],
         "model_type": ("AutoModelForSequenceClassification" if kind == "reward_model"
                        else "AutoModelForTokenClassification"),
         "sequence_len": 64, "micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 3,
         "learning_rate": 5e-3, "lr_scheduler": "constant", "optimizer": "adamw", "max_grad_norm": None,
         "sample_packing": False, "logging": {"log_every": 1, "output_dir": str(out), "plot": False}, **over}
    return TrainConfig.from_dict(d, name=kind)


def _batch(cfg: TrainConfig, step: int, devices: int = 1) -> dict:
    """Step ``step``'s global batch (micro_batch_size rows on each of ``devices`` data-parallel devices)."""
    from functional_pp.app.reward_run import load_reward_data
    return PairLoader(load_reward_data(cfg).train, global_batch_size=cfg.micro_batch_size * devices,
                      seq_len=cfg.sequence_len, seed=cfg.seed).global_batch(step)


def test_reward_run_equals_trl_past_the_first_step(base, data, tmp_path):
    out = tmp_path / "run"
    cfg = config(base, data[0], out, center_rewards_coefficient=0.01, checkpoint={"save_every": 2})
    train(cfg, simulate=1, stream=io.StringIO())
    m = read_metrics(out / "metrics.jsonl")
    assert [x["step"] for x in m] == [1, 2, 3]
    exported = export_run(out, tmp_path / "hf-step2", step=2)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    batch = _batch(cfg, 2)
    ids = torch.cat([batch["chosen_tokens"], batch["rejected_tokens"]])
    assert model.config.pad_token_id is not None
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "margin": batch["margin"][:, 0]}
    assert inputs["margin"].abs().sum() > 0
    fake = types.SimpleNamespace(model=model, args=types.SimpleNamespace(center_rewards_coefficient=0.01),
                                 accelerator=types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x),
                                 _total_train_tokens=0, _tp_size=1, _metrics={"train": collections.defaultdict(list)})
    model.train()
    with torch.no_grad():
        want = trl.RewardTrainer.compute_loss(fake, model, inputs)
    logged = {k: v[-1] for k, v in fake._metrics["train"].items()}
    assert m[2]["loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    for key in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert m[2][key] == pytest.approx(logged[key], rel=1e-4, abs=1e-5), key
    assert m[0]["loss"] != m[2]["loss"]


def test_reward_run_resumes_exactly(base, data, tmp_path):
    whole = train(config(base, data[0], tmp_path / "whole", max_steps=4), simulate=2, stream=io.StringIO())
    split = config(base, data[0], tmp_path / "split", max_steps=4)
    first = train(split, simulate=2, stop_after=2, stream=io.StringIO())
    second = train(split, simulate=2, resume=True, stream=io.StringIO())
    assert first.stopped and second.start_step == 2
    assert first.losses + second.losses == whole.losses


def test_process_reward_run_equals_token_classification(base, data, tmp_path):
    out = tmp_path / "prm"
    cfg = config(base, data[1], out, "process_reward_model", val_set_size=4, eval_steps=1,
                 checkpoint={"save_every": 2})
    train(cfg, simulate=2, stream=io.StringIO())
    m = [x for x in read_metrics(out / "metrics.jsonl") if "loss" in x]
    exported = export_run(out, tmp_path / "hf-prm", step=2)
    model = transformers.AutoModelForTokenClassification.from_pretrained(exported, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2ForTokenClassification" and model.config.num_labels == 2
    batch = _batch(cfg, 2, devices=2)
    assert (batch["labels"] != -100).sum() >= 8
    with torch.no_grad():
        want = model(input_ids=batch["tokens"], labels=batch["labels"]).loss
    assert m[2]["loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert all("eval_loss" in x for x in m)


def test_lora_trains_the_score_head_whole(base, data, tmp_path):
    out = tmp_path / "lora"
    cfg = config(base, data[0], out, adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True,
                 max_steps=2, checkpoint={"save_every": 1, "keep_last": 2})
    r = train(cfg, simulate=1, stream=io.StringIO())
    assert len(r.losses) == 2 and r.losses[0] != r.losses[1]
    from functional_pp.checkpoint import load_checkpoint
    got = load_checkpoint(out / "checkpoints", keys=["params"]).tree["params"]
    first = transformers.Qwen2ForCausalLM.from_pretrained(base)
    assert "score" in got and got["score"].std() > 0
    # the base is frozen (the file's), the score head trained whole (not its fresh init)
    torch.testing.assert_close(got["embed_tokens"].float(), first.model.embed_tokens.weight.detach())
    before = load_checkpoint(out / "checkpoints", keys=["params"], step=1).tree["params"]
    assert not torch.equal(before["score"], got["score"])
    assert torch.equal(before["embed_tokens"], got["embed_tokens"])
    assert "lora" not in got                          # (all-linear leaves the saved head unadapted, as peft)
    peft = json.loads((export_run(out, tmp_path / "peft") / "adapter_config.json").read_text())
    assert peft["modules_to_save"] == ["score"] and "score" not in peft["target_modules"]


@pytest.mark.parametrize("over,match", [
    (dict(model_type="AutoModelForSequenceClassification", reward_model=False),
     "model_type: AutoModelForSequenceClassification is .* set reward_model: true"),
    (dict(num_labels=2), "reward_model: num_labels 2: .* set num_labels: 1"),
    (dict(rl="dpo"), "reward_model with rl: dpo"),
    (dict(datasets=[{"path": "x.jsonl", "type": "chatml.intel"}]), "datasets\\[0\\].type 'chatml.intel' is not read"),
    (dict(process_reward_model=True), "both set"),
    (dict(model_type="AutoModelForTokenClassification"), "not its head"),
])
def test_bad_reward_keys_are_refused(base, data, tmp_path, over, match):
    with pytest.raises(ConfigError, match=match):
        config(base, data[0], tmp_path / "bad", **over)


def test_prm_keys_elsewhere_are_refused(base, data, tmp_path):
    with pytest.raises(ConfigError, match="center_rewards_coefficient is read by reward_model only"):
        config(base, data[1], tmp_path / "bad", "process_reward_model", center_rewards_coefficient=0.1)
    with pytest.raises(ConfigError, match="step_separator is read by stepwise_supervised"):
        TrainConfig.from_dict({"base_model": str(base), "datasets": [{"path": "x", "step_separator": "\n"}]})
    with pytest.raises(ConfigError, match="step label 3 is not in 0..1"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"prompt": "p", "completions": ["a"], "labels": [3]}) + "\n")
        train(config(base, bad, tmp_path / "bad", "process_reward_model"), simulate=1, stream=io.StringIO())
