"""Examples that hold the model's EOS id inside them: a chat template whose turn end is the model's
EOS (Qwen's ``<|im_end|>``, Mistral's ``</s>``). Each example stays one document (its turns attend
to each other, the token after a turn end is a label like any other), where a stream cut at every
EOS would make each turn a document of its own; packed examples are still kept apart. The first
loss of ``functional-pp train`` equals transformers' on the loader's batch."""
import json

import numpy as np
import pytest
import torch
import yaml
from chat_tokenizer import make_tokenizer

from functional_pp.config import TrainConfig
from functional_pp.data import DataLoader
from functional_pp.data.chat import template_text
from functional_pp.data.formats import build_streams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eos_inside")
    d = root / "model"
    tok = make_tokenizer(d, None, "<|im_end|>", template_text("qwen_25"))
    eos = tok.tok.token_to_id("<|im_end|>")
    torch.manual_seed(0)
    conf = transformers.Qwen2Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    eos_token_id=eos, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(conf).save_pretrained(d)
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"},
                          {"role": "user", "content": f"and {i}?"}, {"role": "assistant", "content": f"b{i}"}]}
            for i in range(6)]
    data = root / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return d, data, eos


def config(tmp_path, d, data, **extra):
    cfg = {"base_model": str(d), "datasets": [{"path": str(data), "type": "chat_template"}],
           "chat_template": "tokenizer_default", "micro_batch_size": 2, "sequence_len": 256, "learning_rate": 1e-3,
           "max_steps": 1, "logging": {"log_every": 1, "plot": False}, **extra}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def streams(tmp_path, d, data, packing):
    from functional_pp.app.inputs import load_tokenizer
    cfg = TrainConfig.from_yaml(config(tmp_path, d, data, sample_packing=packing))
    return build_streams(cfg.datasets, load_tokenizer(cfg), seq_len=256, sample_packing=packing)[0]


@pytest.mark.parametrize("packing", [False, True])
def test_each_example_is_one_document(files, tmp_path, packing):
    d, data, eos = files
    train = streams(tmp_path, d, data, packing)
    tokens = np.asarray(train.tokens)
    assert train.starts is not None and (tokens == eos).sum() >= 4 * 6      # two turns end in EOS per example
    firsts = np.flatnonzero(np.asarray(train.starts))
    loader = DataLoader(train, global_batch_size=2, seq_len=256)
    batch = loader.global_batch(0)
    for row, start in zip(batch["segments"], loader.window_starts(0)):
        begun = set((firsts - start)[(firsts > start) & (firsts < start + 256)].tolist())
        changes = set(np.flatnonzero(np.diff(row.numpy())) + 1)
        assert changes == begun                    # a new segment exactly where an example (or padding) begins
    inside = [p for p in range(1, len(tokens) - 1) if tokens[p - 1] == eos and not train.starts[p]]
    assert len(inside) >= 6                        # turn ends inside examples: no document starts after them


def test_cli_first_loss_equals_transformers(files, tmp_path):
    d, data, _ = files
    from functional_pp import cli
    train = streams(tmp_path, d, data, False)
    seed = TrainConfig.from_yaml(config(tmp_path, d, data)).seed
    loader = DataLoader(train, global_batch_size=4, seq_len=256, seed=seed)     # (2 per device x 2 devices)
    batch = loader.global_batch(0)
    out = tmp_path / "run"
    config(tmp_path, d, data, sample_packing=False, dp_shard_size=2)
    assert cli.main(["train", str(tmp_path / "train.yaml"), "--simulate", "2", "--output", str(out)]) == 0
    got = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    model = transformers.Qwen2ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    assert abs(got - want.item()) < 1e-5 * abs(want.item())
