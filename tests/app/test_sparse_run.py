"""``llmcompressor:`` with Axolotl's LLMCompressorPlugin (its llama-3/sparse-finetuning.yaml's recipe)
on a 2:4 sparse tiny Llama made by transformers, FSDP over 2 simulated devices: the targeted
weights' zeros are zero in every checkpoint, their other entries train, the run
resumes bit-exactly (the mask is checkpointed with the optimizer), and bad recipes are refused by
name before any work."""
import copy
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from functional_pp import checkpoint as ck
from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.core.tree import leaves_with_paths

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
CORPUS = Path(__file__).resolve().parents[1] / "data" / "axolotl_examples" / "corpus" / "llama-3"
RECIPE = yaml.safe_load((CORPUS / "sparse-finetuning.yaml").read_text())["llmcompressor"]
PLUGIN = "axolotl.integrations.llm_compressor.LLMCompressorPlugin"
TARGETED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny Llama whose targeted weights are 2:4 sparse (2 of every 4 inputs zero, as
    Sparse-Llama-3.1-8B-2of4's), its tokenizer and local alpaca rows."""
    from chat_tokenizer import make_tokenizer
    root = tmp_path_factory.mktemp("sparse")
    model_dir = root / "tiny-sparse-llama"
    make_tokenizer(model_dir, "<|begin_of_text|>", "<|end_of_text|>")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128))
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(tuple(f"{t}.weight" for t in TARGETED)):
                groups = w.view(w.shape[0], -1, 4)
                groups.mul_(torch.rand(groups.shape).argsort(dim=-1) < 2)
    model.save_pretrained(model_dir)
    rows = root / "alpaca.jsonl"
    rows.write_text("".join(json.dumps({"instruction": f"Add {i} and {i}.", "input": "", "output": f"{2 * i}"}) + "\n"
                            for i in range(64)))
    return model_dir, rows


def config(inputs, out, **kw):
    model_dir, rows = inputs
    d = {"base_model": str(model_dir), "plugins": [PLUGIN], "llmcompressor": copy.deepcopy(RECIPE),
         "datasets": [{"path": str(rows), "type": "alpaca"}], "sequence_len": 64, "sample_packing": True,
         "micro_batch_size": 2, "dp_shard_size": 2, "max_steps": 4, "learning_rate": 1e-2, "optimizer": "adamw_torch",
         "output_dir": str(out), "save_steps": 2, "logging_steps": 1, **kw}
    return TrainConfig.from_dict(d, name="t")


def params_at(out, step):
    return dict(leaves_with_paths(ck.load_checkpoint(out / "checkpoints", step=step, keys=["params"]).tree["params"]))


def test_zeros_stay_zero_others_train_and_resume_is_bit_exact(inputs, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    text = io.StringIO()
    train(config(inputs, full), stream=text)
    assert "compressed-tensors' sparse format is not written" in text.getvalue()
    train(config(inputs, split), stop_after=2, stream=io.StringIO())
    train(config(inputs, split), resume=True, stream=io.StringIO())
    losses = [[m["loss"] for m in read_metrics(out / "metrics.jsonl")] for out in (full, split)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    start, end, resumed = params_at(full, 2), params_at(full, 4), params_at(split, 4)
    assert all(np.array_equal(end[p].numpy(), resumed[p].numpy()) for p in end)
    hf = dict(transformers.LlamaForCausalLM.from_pretrained(inputs[0]).named_parameters())
    checked = 0
    for p, x in end.items():
        if p.rsplit(".", 1)[-1] not in TARGETED:
            continue
        loaded = hf["model." + p + ".weight"].detach()
        zeros = torch.as_tensor(loaded == 0)
        ours = x.reshape(loaded.T.shape).T if x.dim() == 2 else None       # (ours: [in, out]; HF's [out, in])
        if ours is None:                                     # (q/k/v/o: heads split out; compare by count)
            assert int((x == 0).sum()) == int(zeros.sum()), p
        else:
            assert (ours[zeros] == 0).all() and (ours[~zeros] != loaded[~zeros]).all(), p
        assert int((start[p] == 0).sum()) == int(zeros.sum()), p
        checked += 1
    assert checked == 14


def test_pipeline_stages_keep_the_zeros(inputs, tmp_path):
    """(pp_size 2: each stage's optimizer holds its layers' masks)"""
    train(config(inputs, tmp_path, dp_shard_size=1, pp_size=2, max_steps=2,
                 gradient_accumulation_steps=2), stream=io.StringIO())
    hf = dict(transformers.LlamaForCausalLM.from_pretrained(inputs[0]).named_parameters())
    end = params_at(tmp_path, 2)
    for p, x in end.items():
        if p.rsplit(".", 1)[-1] in TARGETED:
            loaded = hf["model." + p + ".weight"].detach()
            assert int((x == 0).sum()) == int((loaded == 0).sum()) and not torch.equal(x.flatten().sort()[0],
                                                                                       loaded.flatten().sort()[0]), p


@pytest.mark.parametrize("change, message", [
    ({"plugins": []}, "go together"),
    ({"llmcompressor": {"recipe": {"s": {"finetuning_modifiers": {"GPTQModifier": {"targets": "Linear"}}}}}},
     "only ConstantPruningModifier .* GPTQModifier is not"),
    ({"llmcompressor": {"recipe": {"s": {"finetuning_modifiers": {"ConstantPruningModifier": {
        "targets": ["re:.*q_proj.weight"], "start": 2}}}}}}, "only start 0 is built"),
    ({"llmcompressor": {"recipe": "recipe.yaml"}}, "a recipe given as text or a file is not read"),
    ({"llmcompressor": {**RECIPE, "compress": True}}, "llmcompressor.compress is not an option"),
    ({"adapter": "lora", "lora_r": 4, "lora_target_modules": ["q_proj"]}, "llmcompressor with adapter"),
])
def test_bad_recipes_are_refused_by_name(inputs, tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        config(inputs, tmp_path, **change)


def test_a_target_naming_no_parameter_is_refused_before_training(inputs, tmp_path):
    recipe = {"recipe": {"s": {"finetuning_modifiers": {"ConstantPruningModifier": {
        "targets": ["re:.*q_proj.weight", "re:.*qproj.weight"], "start": 0}}}}}
    with pytest.raises(ConfigError, match=r"target 're:\.\*qproj\.weight' names no parameter"):
        train(config(inputs, tmp_path / "out", llmcompressor=recipe), stream=io.StringIO())
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
