"""Damaged files the run reads besides the data are named in the error with the way out
(issue 46): a cut ``tokenizer.json`` (``tokenizers`` raised a bare ``Exception`` without the
file: a traceback) and a cut or edited entry of ``dataset_prepared_path``."""
import json

import numpy as np
import pytest

from functional_pp.app import inputs
from functional_pp.config import ConfigError, TrainConfig

tokenizers = pytest.importorskip("tokenizers")


def test_a_cut_tokenizer_json_is_named(tmp_path):
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
    tok.save(str(tmp_path / "tokenizer.json"))
    whole = (tmp_path / "tokenizer.json").read_text()
    cfg = TrainConfig.from_dict({"tokenizer": str(tmp_path)})
    assert inputs.load_tokenizer(cfg).vocab_size == 3
    (tmp_path / "tokenizer.json").write_text(whole[: len(whole) // 2])
    with pytest.raises(ConfigError, match=f"tokenizer: {tmp_path / 'tokenizer.json'} is not a tokenizer the "
                                          f"'tokenizers' package can read .*copy it again"):
        inputs.load_tokenizer(cfg)


@pytest.mark.parametrize("key", ["eos_token_id", "bos_token_id"])
def test_a_special_token_id_outside_the_vocabulary_is_named(tmp_path, key):
    """config.json's eos_token_id 5000 with a 3-token tokenizer: the id separated every packed
    document and the run stopped at its first step naming a token id in the data."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    cfg = TrainConfig.from_dict({"tokenizer": str(tmp_path)})
    (tmp_path / "config.json").write_text(json.dumps({key: 2}))
    assert inputs.load_tokenizer(cfg).vocab_size == 3
    (tmp_path / "config.json").write_text(json.dumps({key: 5000}))
    with pytest.raises(ConfigError, match=f"tokenizer: {key}: 5000 in {tmp_path / 'config.json'} .*outside the "
                                          f"tokenizer's vocabulary of 3 ids .*fix {key} there"):
        inputs.load_tokenizer(cfg)


def _cfg(tmp_path):
    return TrainConfig.from_dict({"datasets": [{"path": str(tmp_path / "a.jsonl"), "type": "alpaca"}],
                                  "dataset_prepared_path": str(tmp_path / "prepared"), "sequence_len": 32})


@pytest.mark.parametrize("damage, named", [
    (lambda d: (d / "train_tokens.npy").write_bytes((d / "train_tokens.npy").read_bytes()[:-7]), "train_tokens.npy"),
    (lambda d: (d / "train_trained.npy").write_bytes(b"\x93NUMPY garbage"), "train_trained.npy"),
    (lambda d: (d / "meta.json").write_text('{"train": {"eos_id": 2'), "meta.json"),
    (lambda d: np.save(d / "train_trained.npy", np.ones(3, np.uint8)), "train_trained.npy holds 3 flags for"),
])
def test_a_damaged_prepared_entry_is_named_with_the_way_out(tmp_path, damage, named):
    rows = [{"instruction": f"Add {i} and {i}.", "input": "", "output": str(2 * i)} for i in range(8)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = inputs.load_data(_cfg(tmp_path))
    entry = next((tmp_path / "prepared").iterdir())
    assert inputs.load_data(_cfg(tmp_path)).train.tokens.tolist() == first.train.tokens.tolist()
    damage(entry)
    with pytest.raises(ConfigError, match=f"the tokenized datasets in {entry} are damaged .*{named}.*delete {entry} "
                                          f"to tokenize the datasets again"):
        inputs.load_data(_cfg(tmp_path))
