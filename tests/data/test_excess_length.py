"""Rows longer than ``sequence_len`` without packing (issue 46): Axolotl's
``excess_length_strategy`` — ``drop`` (the default: removed and counted), ``truncate`` (cut; no
label is ever trained inside the prompt where the cut fell, and the trained-token count in the
summary is the number of labels the loader trains), ``raise`` (the file, record, its length and
sequence_len named before any training). Through the API and the command line."""
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from functional_pp import cli
from functional_pp.config import DatasetConfig
from functional_pp.data import DataLoader
from functional_pp.data.formats import ALPACA_PROMPT_NO_INPUT, ByteTokenizer, build_streams

EOS = ByteTokenizer().eos_id
L = 192                    # sequence_len: the alpaca prompt alone is longer than this for LONG_PROMPT

SHORT = {"instruction": "Add 2 and 2.", "input": "", "output": "4"}
LONG_PROMPT = {"instruction": "Describe " + "very " * 30 + "carefully.", "input": "", "output": "Done."}
LONG_ANSWER = {"instruction": "Go.", "input": "", "output": "x" * 200}


def _write(tmp_path: Path, rows: list[dict]) -> list[DatasetConfig]:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [DatasetConfig(path=str(tmp_path / "a.jsonl"), type="alpaca")]


def _trained_labels(stream, seq_len: int) -> list[np.ndarray]:
    """Per window (= per unpacked row), the label positions the loader trains."""
    loader = DataLoader(stream, global_batch_size=1, seq_len=seq_len, seed=0)
    out = [None] * loader.num_windows
    for step in range(loader.steps_per_epoch):
        start = int(loader.window_starts(step)[0])
        out[start // seq_len] = np.flatnonzero(loader.global_batch(step)["labels"][0].numpy() != -100)
    return out


def test_unpacked_long_rows_are_dropped_by_default_and_counted(tmp_path):
    entry = _write(tmp_path, [SHORT, LONG_PROMPT, SHORT, LONG_ANSWER, SHORT])
    train, _ = build_streams(entry, None, seq_len=L, sample_packing=False)
    st = train.stats[0]
    assert (st.rows, st.dropped, train.documents) == (3, 2, 3)
    assert f"2 rows longer than sequence_len={L} dropped (excess_length_strategy: drop)" in st.line()
    assert st.trained_tokens == sum(len(w) for w in _trained_labels(train, L))


def test_truncate_never_trains_a_label_inside_the_prompt(tmp_path):
    rows = [SHORT, LONG_PROMPT, LONG_ANSWER]
    entry = _write(tmp_path, rows)
    train, _ = build_streams(entry, None, seq_len=L, sample_packing=False, excess_length_strategy="truncate")
    st = train.stats[0]
    assert st.truncated == 2 and "2 rows longer than sequence_len" in st.line() and "truncated" in st.line()
    windows = _trained_labels(train, L)
    prompt = len(ALPACA_PROMPT_NO_INPUT.format(instruction=LONG_PROMPT["instruction"]).encode())
    assert prompt > L
    assert len(windows[1]) == 0                        # the whole answer was cut: nothing trained
    answer_start = len(ALPACA_PROMPT_NO_INPUT.format(instruction="Go.").encode())
    # the long answer: its tokens up to the cut, no EOS at the cut (labels at index p-1)
    assert windows[2].tolist() == list(range(answer_start - 1, L - 2))
    assert st.untrained_rows == 1 and st.trained_tokens == sum(len(w) for w in windows)


def test_raise_names_file_record_length_and_sequence_len(tmp_path):
    entry = _write(tmp_path, [SHORT, SHORT, LONG_ANSWER])
    with pytest.raises(ValueError) as e:
        build_streams(entry, None, seq_len=L, sample_packing=False, excess_length_strategy="raise")
    msg = str(e.value)
    n = len(ALPACA_PROMPT_NO_INPUT.format(instruction="Go.").encode()) + 200 + 1
    assert "datasets[0]" in msg and "a.jsonl" in msg and "record 3" in msg
    assert f"{n} tokens" in msg and f"sequence_len={L}" in msg and "excess_length_strategy" in msg


def test_packed_documents_longer_than_sequence_len_are_counted(tmp_path):
    entry = _write(tmp_path, [SHORT, LONG_ANSWER, SHORT])
    train, _ = build_streams(entry, None, seq_len=L)
    assert train.stats[0].spanning == 1 and "1 rows longer than sequence_len" in train.stats[0].line()


def _cli(tmp_path: Path, capsys, rows: list[dict], **keys) -> tuple[int, str, str]:
    entry = _write(tmp_path, rows)
    cfg = {"model": "tiny", "micro_batch_size": 1, "sequence_len": L, "max_steps": 1, "sample_packing": False,
           "datasets": [{"path": entry[0].path, "type": "alpaca"}], "output_dir": str(tmp_path / "out"), **keys}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    status = cli.main(["train", str(tmp_path / "c.yaml"), "--simulate", "1"])
    cap = capsys.readouterr()
    return status, cap.out, cap.err


def test_cli_says_how_many_rows_it_dropped(tmp_path, capsys):
    status, out, err = _cli(tmp_path, capsys, [SHORT, LONG_PROMPT, SHORT, SHORT])
    assert status == 0, err
    assert f"3 rows" in out and f"1 rows longer than sequence_len={L} dropped" in out


def test_cli_refuses_when_every_row_is_too_long(tmp_path, capsys):
    status, out, err = _cli(tmp_path, capsys, [LONG_PROMPT, LONG_ANSWER])
    assert status == 2 and "all 2 rows are longer than sequence_len" in err and "excess_length_strategy" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_cli_raise_stops_before_training(tmp_path, capsys):
    status, out, err = _cli(tmp_path, capsys, [SHORT, LONG_ANSWER], excess_length_strategy="raise")
    assert status == 2 and "record 2" in err and f"sequence_len={L}" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
