"""Records that would be misread are refused naming the dataset, the file and the record or line
(issue 46): ``"output": null`` (it trained the text "None"), a list where text belongs, chat
content that is not text, bytes that are not UTF-8. Through the API and the command line."""
import json
from pathlib import Path

import pytest
import yaml

from functional_pp import cli
from functional_pp.config import DatasetConfig
from functional_pp.data.formats import build_streams

GOOD = {"instruction": "Add 2 and 2.", "input": "", "output": "4"}


def _alpaca(tmp_path: Path, rows: list[dict]) -> list[DatasetConfig]:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [DatasetConfig(path=str(tmp_path / "a.jsonl"), type="alpaca")]


@pytest.mark.parametrize("row, words", [
    ({**GOOD, "output": None}, "field 'output' is null, not text"),
    ({**GOOD, "instruction": ["a", "b"]}, "field 'instruction' is list [\"a\", \"b\"], not text"),
    ({**GOOD, "input": {"k": 1}}, "field 'input' is dict {\"k\": 1}, not text; give it text or leave it out"),
])
def test_alpaca_fields_that_are_not_text_are_refused(tmp_path, row, words):
    entry = _alpaca(tmp_path, [GOOD, row])
    with pytest.raises(ValueError) as e:
        build_streams(entry, None, seq_len=256)
    assert str(e.value).startswith(f"datasets[0] ({tmp_path / 'a.jsonl'}): record 2: ") and words in str(e.value)


def test_numbers_are_written_out_and_a_null_input_is_no_input(tmp_path):
    train, _ = build_streams(_alpaca(tmp_path, [{**GOOD, "output": 4, "input": None}]), None, seq_len=256)
    text = bytes(int(t) for t in train.tokens).decode()
    assert text.endswith("### Response:\n4\0") and "None" not in text


def test_chat_content_that_is_not_text_is_refused(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 4}]}]
    (tmp_path / "c.jsonl").write_text(json.dumps(rows[0]) + "\n")
    entry = [DatasetConfig(path=str(tmp_path / "c.jsonl"), type="chat_template", chat_template="chatml")]
    with pytest.raises(ValueError) as e:
        build_streams(entry, None, seq_len=256)
    assert f"datasets[0] ({tmp_path / 'c.jsonl'}): record 1: message 2: content is int (4), not text" in str(e.value)


def test_cli_names_file_and_line_of_bytes_that_are_not_utf8(tmp_path, capsys):
    path = tmp_path / "a.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"instruction": "caf\xe9", "output": "x"}\n')
    cfg = {"model": "tiny", "micro_batch_size": 1, "sequence_len": 256, "max_steps": 1,
           "datasets": [{"path": str(path), "type": "alpaca"}], "output_dir": str(tmp_path / "out")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", str(tmp_path / "c.yaml"), "--simulate", "1"]) == 2
    err = capsys.readouterr().err
    offset = len(json.dumps(GOOD)) + 1 + 20
    assert f"datasets[0] ({path}): line 2: not UTF-8 (byte 0xe9 at byte offset {offset} of the file, column 21)" in err
    assert not (tmp_path / "out").exists()


def test_a_split_other_than_train_of_a_single_file_is_refused(tmp_path):
    """``split: test`` on a JSON-lines file was ignored: the whole file trained as if it were the
    test split (Hugging Face ``datasets`` calls a single file's split ``train`` and refuses others)."""
    entry = _alpaca(tmp_path, [GOOD])[0]
    entry.split = "test"
    with pytest.raises(ValueError, match=r"split 'test': .*a.jsonl is one file, read whole as the split 'train'"):
        build_streams([entry], None, seq_len=256)


@pytest.mark.parametrize("split, keep", [("train[:20%]", slice(0, 2)), ("train[5:]", slice(5, 10)),
                                         ("train[10%:-3]", slice(1, 7))])
def test_a_sliced_train_split_of_a_single_file_keeps_those_rows(tmp_path, split, keep):
    """Axolotl configs write HF datasets' slice notation (``split: train[:20%]``): the rows of the
    slice train, exactly as a file holding only those rows."""
    rows = [{**GOOD, "output": f"answer {i}"} for i in range(10)]
    entry = _alpaca(tmp_path, rows)[0]
    entry.split = split
    got, _ = build_streams([entry], None, seq_len=256)
    (tmp_path / "want").mkdir()
    want, _ = build_streams(_alpaca(tmp_path / "want", rows[keep]), None, seq_len=256)
    assert got.tokens.tolist() == want.tokens.tolist()


def test_a_split_that_is_no_slice_is_refused(tmp_path):
    entry = _alpaca(tmp_path, [GOOD])[0]
    entry.split = "train[:half]"
    with pytest.raises(ValueError, match=r"split 'train\[:half\]' is not a split name or a slice"):
        build_streams([entry], None, seq_len=256)


def test_a_folder_of_data_files_is_refused_naming_its_files(tmp_path):
    """datasets' load_from_disk said "neither a `Dataset` directory nor a `DatasetDict` directory"
    for a folder of JSON lines files: neither the files nor the fix."""
    (tmp_path / "d").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "d" / name).write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"datasets\[0\] .*/d is a directory but not a Hugging Face dataset written "
                                         r"by save_to_disk .*it holds a.jsonl, b.jsonl: give each file as a datasets "
                                         r"entry of its own \(path: .*/d/a.jsonl\)"):
        build_streams([DatasetConfig(path=str(tmp_path / "d"), type="alpaca")], None, seq_len=8)
