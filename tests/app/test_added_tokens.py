"""Axolotl's ``tokens``: added to the tokenizer as single tokens, the embedding and head grow to
hold them with the new rows initialised as transformers' resize_token_embeddings does (the mean
of the old rows); a base_model run with them trains on 2 simulated devices and exports a model
and tokenizer that transformers loads with the new vocabulary."""
import json

import pytest
import torch
import yaml

from functional_pp import cli
from functional_pp.checkpoint import hf
from functional_pp.config import TrainConfig, model_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
NEW = ["<|tool_a|>", "<|tool_b|>"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from chat_tokenizer import make_tokenizer
    d = tmp_path_factory.mktemp("base")
    tok = make_tokenizer(d, None, "<|im_end|>")
    conf = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                    max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(conf)
    model.save_pretrained(d)
    return d, model, tok.vocab_size


def test_new_rows_are_the_mean_of_the_old_as_transformers_resize(base):
    d, model, vocab = base
    cfg = TrainConfig.from_dict({"base_model": str(d), "tokens": NEW + ["<|im_end|>"]})   # one exists
    grown = model_config(cfg)
    assert grown.vocab == vocab + 2
    ours = hf.load_hf_params(d, grown, dtype=torch.float32, grow_vocab=True)
    ref = transformers.LlamaForCausalLM(model.config)
    ref.load_state_dict(model.state_dict())
    ref.resize_token_embeddings(vocab + 2)                      # mean resizing (transformers' default)
    emb, head = ref.get_input_embeddings().weight.detach(), ref.get_output_embeddings().weight.detach()
    assert torch.equal(ours["embed_tokens"][:vocab], emb[:vocab])
    assert torch.allclose(ours["embed_tokens"][vocab:], emb[vocab:], atol=1e-4)         # theirs: + 1e-9 cov noise
    assert torch.allclose(ours["embed_tokens"][vocab:], emb[:vocab].mean(0).expand(2, -1), atol=1e-6)
    assert torch.allclose(ours["lm_head"].T[vocab:], head[vocab:], atol=1e-4)
    with pytest.raises(Exception, match="shape mismatch"):
        hf.load_hf_params(d, grown, dtype=torch.float32)         # without tokens: refused


def test_a_run_with_added_tokens_trains_and_exports(base, tmp_path, capsys):
    d, _, vocab = base
    rows = [{"text": f"call {NEW[i % 2]} with {i}"} for i in range(40)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"base_model": str(d), "tokens": NEW, "datasets": [{"path": str(tmp_path / "c.jsonl"),
                                                              "type": "completion"}],
           "sequence_len": 32, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3,
           "output_dir": str(tmp_path / "out")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", str(tmp_path / "c.yaml"), "--simulate", "2"]) == 0
    assert f"vocab {vocab + 2}" in capsys.readouterr().out
    assert cli.main(["export", str(tmp_path / "out"), str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert model.get_input_embeddings().weight.shape[0] == vocab + 2 == len(tok)
    assert tok.convert_tokens_to_ids(NEW) == [vocab, vocab + 1]


def test_resize_token_embeddings_to_32x_rounds_the_grown_vocabulary_up(base):
    d, _, vocab = base
    cfg = TrainConfig.from_dict({"base_model": str(d), "tokens": NEW, "resize_token_embeddings_to_32x": True})
    grown = model_config(cfg)
    assert grown.vocab == -(-(vocab + 2) // 32) * 32 > vocab + 2
    ours = hf.load_hf_params(d, grown, dtype=torch.float32, grow_vocab=True)
    old = ours["embed_tokens"][:vocab]
    assert torch.allclose(ours["embed_tokens"][vocab:], old.mean(0).expand(grown.vocab - vocab, -1), atol=1e-6)
