"""Exports never mix old and new files (issue 46): ``functional-pp export`` into a directory
that held an adapter export (or another model's tokenizer, or more shards) replaces it whole;
a directory holding anything an export does not write is refused and left as it was."""
import json
from pathlib import Path

import pytest
import yaml

from functional_pp import cli

STALE = {"adapter_config.json": "{}", "adapter_model.safetensors": "x", "tokenizer.json": "{\"other\": 1}",
         "model-00002-of-00002.safetensors": "x"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("run")
    cfg = {"model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "max_steps": 1,
           "data": {"max_bytes": 50_000}, "output_dir": str(tmp / "out")}
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", str(tmp / "c.yaml"), "--simulate", "1"]) == 0
    return tmp / "out"


def test_an_earlier_export_is_replaced_whole(run_dir, tmp_path, capsys):
    fresh = tmp_path / "fresh"
    assert cli.main(["export", str(run_dir), str(fresh)]) == 0, capsys.readouterr().err
    written = sorted(p.name for p in fresh.iterdir())
    hf = tmp_path / "hf"
    hf.mkdir()
    for name, text in STALE.items():
        (hf / name).write_text(text)
    assert cli.main(["export", str(run_dir), str(hf)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in hf.iterdir()) == written            # nothing of the old export left
    assert json.loads((hf / "config.json").read_text()) == json.loads((fresh / "config.json").read_text())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary left


def test_a_directory_with_other_files_is_refused_untouched(run_dir, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "config.json").write_text("{\"mine\": 1}")
    assert cli.main(["export", str(run_dir), str(mine)]) == 2
    err = capsys.readouterr().err
    assert f"{mine} holds files that are not an export (notes.txt)" in err and "new or empty directory" in err
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"]
    assert (mine / "config.json").read_text() == "{\"mine\": 1}"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]
