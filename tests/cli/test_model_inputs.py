"""Model inputs checked before any work (docs/bad_inputs.md §13): ``sequence_len`` within the
model's positions, and a base model directory that holds its weights."""
import json
from pathlib import Path

import transformers
import yaml

from functional_pp import cli

HF = dict(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
          intermediate_size=64, max_position_embeddings=64)


def _config(path: Path, **kw) -> Path:
    cfg = {"micro_batch_size": 1, "sequence_len": 32, "max_steps": 1, "model": "tiny", "data": {"max_bytes": 20_000},
           "logging": {"output_dir": str(path.parent / "out")}}
    cfg.update(kw)
    if "base_model" in kw:
        del cfg["model"]
    path.write_text(yaml.safe_dump(cfg))
    return path


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def _base(tmp_path: Path, weights: bool = True) -> Path:
    d = tmp_path / "base"
    if weights:
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).save_pretrained(d)
    else:
        transformers.LlamaConfig(**HF).save_pretrained(d)
    return d


def test_sequence_len_beyond_a_presets_positions(tmp_path, capsys):
    err = _error(capsys, ["train", str(_config(tmp_path / "c.yaml", sequence_len=100_000))])
    assert "sequence_len=100000 is longer than the model's positions: model preset 'tiny' has max_seq=512" in err
    assert "model: {max_seq: 100000}" in err
    assert not (tmp_path / "out").exists()                     # refused before any work
    # the fix it names works (validated only: a preset may be given more positions)
    assert cli.main(["validate", str(_config(tmp_path / "c.yaml", sequence_len=1024,
                                             model={"preset": "tiny", "max_seq": 1024}))]) == 0


def test_sequence_len_beyond_a_base_models_positions(tmp_path, capsys):
    base = _base(tmp_path)
    cfg = _config(tmp_path / "c.yaml", base_model=str(base), sequence_len=128)
    err = _error(capsys, ["train", str(cfg)])
    assert "sequence_len=128 is longer than the model's positions" in err
    assert "max_position_embeddings=64" in err and "lower sequence_len to at most 64" in err


def test_base_model_without_weights_is_refused_before_work(tmp_path, capsys):
    base = _base(tmp_path, weights=False)
    cfg = _config(tmp_path / "c.yaml", base_model=str(base))
    err = _error(capsys, ["train", str(cfg)])
    assert f"base_model {str(base)!r}" in err and "no model.safetensors or model.safetensors.index.json" in err
    assert "DeviceError" not in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_base_model_with_a_missing_shard_is_refused_before_work(tmp_path, capsys):
    base = _base(tmp_path)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (base / "model.safetensors").rename(base / names[0])
    (base / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": names[0], "lm_head.weight": names[1]}}))
    err = _error(capsys, ["train", str(_config(tmp_path / "c.yaml", base_model=str(base)))])
    assert "lists 1 weight file(s) that are missing: model-00002-of-00002.safetensors" in err
