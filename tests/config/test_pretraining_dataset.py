"""Axolotl's ``pretraining_dataset`` (``type: pretrain``, the text in ``text_column``): the same
training as the local files given as ``datasets`` of ``type: completion`` packed to
``sequence_len`` (the same losses, step by step); bad entries
are refused by name before any work."""
import io
import json

import pytest
import torch

from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import ConfigError, TrainConfig

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from chat_tokenizer import make_tokenizer
    d = tmp_path_factory.mktemp("base")
    tok = make_tokenizer(d, None, "<|im_end|>")
    conf = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                    max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(conf).save_pretrained(d)
    rows = [{"content": f"document {i}: " + "lorem ipsum " * (i % 5 + 1)} for i in range(48)]
    (d / "web.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def config(base, out, **kw):
    return TrainConfig.from_dict({"base_model": str(base), "sequence_len": 32, "micro_batch_size": 2,
                                  "max_steps": 3, "learning_rate": 1e-3, "dp_shard_size": 2,
                                  "output_dir": str(out), **kw}, name="t")


def losses(out):
    return [m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m]


def test_pretraining_dataset_trains_as_packed_completion_data(base, tmp_path):
    web = str(base / "web.jsonl")
    train(config(base, tmp_path / "pre", pretraining_dataset=[{"path": web, "type": "pretrain",
                                                               "text_column": "content"}]), stream=io.StringIO())
    train(config(base, tmp_path / "ds", datasets=[{"path": web, "type": "completion", "field": "content"}],
                 sample_packing=True), stream=io.StringIO())
    assert len(losses(tmp_path / "pre")) == 3
    assert losses(tmp_path / "pre") == losses(tmp_path / "ds")


@pytest.mark.parametrize("change, message", [
    ({"datasets": [{"path": "x.jsonl", "type": "completion"}]}, "pretraining_dataset and datasets are both set"),
    ({"sample_packing": False}, "pretraining_dataset with sample_packing: false"),
    ({"pretraining_dataset": [{"path": "x.jsonl", "type": "alpaca"}]}, r"pretraining_dataset\[0\].type: 'alpaca'"),
    ({"pretraining_dataset": [{"path": "x.jsonl", "skip": 10}]}, r"pretraining_dataset\[0\].skip"),
])
def test_bad_pretraining_entries_are_refused_by_name(base, tmp_path, change, message):
    kw = {"pretraining_dataset": [{"path": "x.jsonl", "type": "pretrain"}], **change}
    with pytest.raises(ConfigError, match=message):
        config(base, tmp_path, **kw)
