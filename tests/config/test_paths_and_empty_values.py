"""Settings read as a shell user expects (issue 46): ``~`` and environment variables expanded
in every path key (``output_dir: ~/runs`` wrote into a folder named ``~``), an unset variable
refused naming the key; ``--set key=`` with nothing after ``=`` (an unset shell variable) is
refused instead of silently replacing the file's value with the default."""
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from functional_pp import cli
from functional_pp.config import ConfigError, TrainConfig


def test_home_and_variables_are_expanded_in_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FPP_DATA", str(tmp_path / "data"))
    cfg = TrainConfig.from_dict({"output_dir": "~/runs/a", "datasets": [{"path": "$FPP_DATA/a.jsonl"}],
                                 "dataset_prepared_path": "${FPP_DATA}/prepared", "base_model": "~/model"})
    assert cfg.output_dir() == tmp_path / "runs" / "a"
    assert cfg.datasets[0].path == str(tmp_path / "data" / "a.jsonl")
    assert cfg.dataset_prepared_path == str(tmp_path / "data" / "prepared")
    assert cfg.base_model == str(tmp_path / "model")
    assert TrainConfig.from_dict({"data": {"path": "~/c.txt"}}).data.path == str(tmp_path / "c.txt")
    # a chat template's text is not a path: "~" is Jinja's concatenation
    assert TrainConfig.from_dict({"chat_template": "jinja", "chat_template_jinja": "{{ a ~ b }}"}) \
        .chat_template_jinja == "{{ a ~ b }}"


def test_an_unset_variable_in_a_path_is_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv("FPP_NOT_SET", raising=False)
    with pytest.raises(ConfigError, match=r"logging.output_dir: '\$FPP_NOT_SET/runs' names the environment "
                                          r"variable FPP_NOT_SET, which is not set"):
        TrainConfig.from_dict({"output_dir": "$FPP_NOT_SET/runs"})


def test_cli_writes_into_the_expanded_output_dir(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": "tiny", "micro_batch_size": 2, "sequence_len": 32,
                                                     "max_steps": 1, "data": {"max_bytes": 50_000},
                                                     "output_dir": "~/runs/a"}))
    assert cli.main(["train", "c.yaml", "--simulate", "1"]) == 0, capsys.readouterr().err
    assert (tmp_path / "home" / "runs" / "a" / "metrics.jsonl").is_file() and not (tmp_path / "~").exists()


def test_an_empty_set_value_is_refused(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"learning_rate": 0.5, "output_dir": str(tmp_path / "o")}))
    with pytest.raises(ConfigError, match=r"--set 'learning_rate=': the value of learning_rate is empty "
                                          r"\(an unset shell variable\?\); give a value, or learning_rate=null"):
        TrainConfig.from_yaml(tmp_path / "c.yaml", ["learning_rate="])
    assert cli.main(["train", str(tmp_path / "c.yaml"), "--set", "learning_rate= "]) == 2
    assert "the value of learning_rate is empty" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert TrainConfig.from_yaml(tmp_path / "c.yaml", ["learning_rate=null"]).learning_rate != 0.5


def test_a_named_pipe_as_a_dataset_is_refused_not_waited_on(tmp_path):
    """A named pipe as ``datasets[].path`` blocked forever waiting for a writer (issue 46); it is
    refused before any work naming the key, the path and what it is (a subprocess: a hang fails
    the test at its timeout instead of holding the suite)."""
    import subprocess
    import sys
    os.mkfifo(tmp_path / "rows.jsonl")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "max_steps": 1, "output_dir": str(tmp_path / "o"),
        "datasets": [{"path": str(tmp_path / "rows.jsonl"), "type": "completion"}]}))
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-m", "functional_pp", "validate", str(tmp_path / "c.yaml")],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(root)))
    assert res.returncode == 2, res.stderr
    assert f"datasets[0].path '{tmp_path / 'rows.jsonl'}' is a named pipe (FIFO), not a file or directory" in res.stderr
    assert "write the data to a file first" in res.stderr and not (tmp_path / "o").exists()


def test_data_tokenizer_may_be_a_directory_as_the_tokenizer_key(tmp_path):
    """``data.tokenizer`` naming a directory that holds ``tokenizer.json`` (what ``tokenizer:`` and the
    reader accept) was refused with the named-pipe message, "data is read more than once"."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from functional_pp.app import inputs
    from functional_pp.config.checks import _check_paths
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("a b a b c " * 40)
    cfg = TrainConfig.from_dict({"model": "tiny", "sequence_len": 8,
                                 "data": {"path": str(tmp_path / "t.txt"), "tokenizer": str(tmp_path / "tok")}})
    _check_paths(cfg)
    assert set(np.unique(inputs.load_data(cfg).train.tokens).tolist()) == {0, 1, 2}
