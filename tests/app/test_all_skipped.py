"""A run that learned nothing does not say "done" (issue 46): NaN in the weights skips every
step; a run shorter than ``max_consecutive_skips`` used to end with exit 0. Now it exits 3
(non-finite) naming the count; a run with some good steps still ends 0."""
import yaml

from functional_pp import cli
from functional_pp.parallel import init as init_module


def _run(tmp_path, capsys, monkeypatch, nan: bool) -> tuple[int, str]:
    real = init_module.init

    def with_nan(*a, **k):
        params = real(*a, **k)
        if nan:
            params["norm"].data.fill_(float("nan"))          # a weight as a bad base model holds it
        return params
    monkeypatch.setattr(init_module, "init", with_nan)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": "tiny", "micro_batch_size": 2, "sequence_len": 32,
                                                     "max_steps": 3, "data": {"max_bytes": 50_000},
                                                     "output_dir": str(tmp_path / "out")}))
    status = cli.main(["train", str(tmp_path / "c.yaml"), "--simulate", "1"])
    return status, capsys.readouterr().err


def test_every_step_skipped_exits_3(tmp_path, capsys, monkeypatch):
    status, err = _run(tmp_path, capsys, monkeypatch, nan=True)
    assert status == 3, err
    assert "all 3 steps of this run were skipped" in err and "nothing was learned" in err


def test_a_normal_run_still_ends_0(tmp_path, capsys, monkeypatch):
    status, err = _run(tmp_path, capsys, monkeypatch, nan=False)
    assert status == 0, err
