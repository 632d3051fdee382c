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
