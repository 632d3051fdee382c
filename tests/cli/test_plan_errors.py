"""``functional-pp plan`` is behind the one-line error handler like every command (issue 46): a
missing base model is one line on stderr, not a traceback."""
import yaml

from functional_pp import cli


def test_plan_with_a_missing_base_model_is_one_line(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"base_model": str(tmp_path / "nope")}))
    status = cli.main(["plan", str(tmp_path / "c.yaml"), "--devices", "2"])
    err = capsys.readouterr().err
    assert status in (1, 2) and "Traceback" not in err
    assert err.startswith("functional-pp: ") and len(err.strip().splitlines()) == 1 and "nope" in err


def _tiny(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": "tiny", "micro_batch_size": 1, "sequence_len": 64}))
    return str(tmp_path / "c.yaml")


def _no_search(monkeypatch, seen):
    from functional_pp.cli import plan

    def record(cfg, *a, **k):
        seen.append(cfg)
        raise RuntimeError("stop after reading the config")
    monkeypatch.setattr(plan, "rank_layouts", record)


def test_plan_json_into_a_missing_folder_is_refused_before_the_search(tmp_path, capsys, monkeypatch):
    seen = []
    _no_search(monkeypatch, seen)
    target = tmp_path / "missing" / "plan.json"
    assert cli.main(["plan", _tiny(tmp_path), "--devices", "2", "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"--json {target}: folder {target.parent} does not exist; create it (mkdir -p {target.parent})" in err
    assert seen == []                                       # no search ran
    assert cli.main(["plan", _tiny(tmp_path), "--devices", "2", "--json", str(tmp_path)]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err and seen == []


def test_plan_takes_set_like_train_and_validate(tmp_path, capsys, monkeypatch):
    seen = []
    _no_search(monkeypatch, seen)
    assert cli.main(["plan", _tiny(tmp_path), "--devices", "2", "--set", "sequence_len=128"]) == 1
    assert [c.sequence_len for c in seen] == [128]
    assert cli.main(["plan", _tiny(tmp_path), "--devices", "2", "--set", "learning_rate="]) == 2
    assert "the value of learning_rate is empty" in capsys.readouterr().err and len(seen) == 1
