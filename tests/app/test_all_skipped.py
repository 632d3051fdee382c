"""A run that learned nothing does not say "done" (issue 46): NaN in the weights skips every
step; a run shorter than ``max_consecutive_skips`` used to end with exit 0. Now it exits 3
(non-finite) naming the count; a run with some good steps still ends 0."""
import json

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


def _alpaca_run(tmp_path, capsys, instruction: str) -> tuple[int, str]:
    rows = [{"instruction": instruction, "input": "", "output": "y"} for _ in range(8)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "max_steps": 3,
        "datasets": [{"path": str(tmp_path / "d.jsonl"), "type": "alpaca"}],
        "logging": {"plot": False}, "output_dir": str(tmp_path / "out")}))
    status = cli.main(["train", str(tmp_path / "c.yaml"), "--simulate", "1"])
    captured = capsys.readouterr()
    return status, captured.err + captured.out


def test_a_run_whose_steps_train_no_token_is_not_done(tmp_path, capsys):
    """Packed rows whose one trained token (the answer) lies 400 bytes after the prompt: the
    first steps' windows hold prompts only, every label ignored; the run said "done" with loss
    0.0000 and exit 0."""
    status, text = _alpaca_run(tmp_path, capsys, "x " * 200)
    assert status == 1, text
    assert "NothingTrainedError: none of the 3 steps of this run trained a token" in text
    assert "nothing was learned" in text and "done:" not in text


def test_a_run_with_some_steps_that_train_no_token_is_done_and_says_how_many(tmp_path, capsys):
    """Short rows: the alpaca prompt (~150 bytes) fills whole 32-byte windows, so some steps
    train nothing (said), one trains the answers (done, exit 0)."""
    status, text = _alpaca_run(tmp_path, capsys, "Say y.")
    assert status == 0, text
    assert "note: 2 of 3 steps trained no token" in text and "done: step 3/3" in text
