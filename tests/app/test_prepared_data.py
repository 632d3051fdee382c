"""dataset_prepared_path (Axolotl's): the tokenized datasets are saved there and reused while
the config and the data are unchanged; a changed data file or setting tokenizes again."""
import json
import os

import numpy as np

from functional_pp.app import inputs
from functional_pp.config import TrainConfig


def _cfg(tmp_path, **keys):
    return TrainConfig.from_dict({"datasets": [{"path": str(tmp_path / "a.jsonl"), "type": "alpaca"}],
                                  "dataset_prepared_path": str(tmp_path / "prepared"), "sequence_len": 32,
                                  "val_set_size": 0.25, **keys})


def _write(tmp_path, n):
    rows = [{"instruction": f"Add {i} and {i}.", "input": "", "output": str(2 * i)} for i in range(n)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tokenized_data_is_saved_reused_and_rebuilt_on_change(tmp_path, monkeypatch):
    _write(tmp_path, 8)
    first = inputs.load_data(_cfg(tmp_path))
    assert first.train.prepared.startswith("tokenized the datasets and saved them in")
    from functional_pp.data import formats

    def no_build(*a, **k):
        raise AssertionError("tokenized again although nothing changed")
    monkeypatch.setattr(formats, "build_streams", no_build)
    again = inputs.load_data(_cfg(tmp_path))
    assert again.train.prepared.startswith("reused the tokenized datasets in")
    assert np.array_equal(again.train.tokens, first.train.tokens)
    assert np.array_equal(again.train.trained, first.train.trained)
    assert np.array_equal(again.val.tokens, first.val.tokens) and again.train.documents == first.train.documents
    assert [s.line() for s in again.train.stats] == [s.line() for s in first.train.stats]
    monkeypatch.undo()
    changed = inputs.load_data(_cfg(tmp_path, sequence_len=64))             # another setting
    assert changed.train.prepared.startswith("tokenized")
    _write(tmp_path, 12)                                                    # other data
    more = inputs.load_data(_cfg(tmp_path))
    assert more.train.prepared.startswith("tokenized") and more.train.documents == 9
    assert len(list((tmp_path / "prepared").iterdir())) == 3


def test_an_edited_chat_template_file_tokenizes_again(tmp_path):
    """The key holds the template file's contents, not only its path (issue 46)."""
    import json as _json
    (tmp_path / "c.jsonl").write_text(_json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                                {"role": "assistant", "content": "Yo"}]}) + "\n")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")

    def cfg():
        return TrainConfig.from_dict({"datasets": [{"path": str(tmp_path / "c.jsonl"), "type": "chat_template"}],
                                      "chat_template": "jinja", "chat_template_jinja": str(template),
                                      "dataset_prepared_path": str(tmp_path / "prepared"), "sequence_len": 32})
    first = inputs.load_data(cfg())
    assert inputs.load_data(cfg()).train.prepared.startswith("reused")
    st = template.stat()
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    os.utime(template, ns=(st.st_atime_ns, st.st_mtime_ns))     # same size and time: only the text differs
    again = inputs.load_data(cfg())
    assert again.train.prepared.startswith("tokenized")
    assert not np.array_equal(np.asarray(again.train.tokens), np.asarray(first.train.tokens))


def test_a_data_file_rewritten_at_the_same_size_and_time_tokenizes_again(tmp_path):
    """The key holds each file's contents (SHA-256), not its size and modification time (issue 46)."""
    _write(tmp_path, 8)
    first = inputs.load_data(_cfg(tmp_path))
    path = tmp_path / "a.jsonl"
    st, text = path.stat(), path.read_text()
    path.write_text(text.replace("Add 3 and 3.", "Add 9 and 9."))           # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))                      # same time
    again = inputs.load_data(_cfg(tmp_path))
    assert again.train.prepared.startswith("tokenized")
    assert not np.array_equal(np.asarray(again.train.tokens), np.asarray(first.train.tokens))


def test_other_tokenizing_code_or_added_tokens_tokenize_again(tmp_path, monkeypatch):
    """The key holds a hash of the data package's sources (an edited reader at the same version
    number) and every setting that shapes the tokens, ``tokens`` included."""
    from functional_pp.data import prepared
    _write(tmp_path, 8)
    inputs.load_data(_cfg(tmp_path))
    assert inputs.load_data(_cfg(tmp_path)).train.prepared.startswith("reused")
    monkeypatch.setattr(prepared, "code_version", lambda: "another-build")
    assert inputs.load_data(_cfg(tmp_path)).train.prepared.startswith("tokenized")
    monkeypatch.undo()
    settings = inputs._data_settings(_cfg(tmp_path))
    assert settings["tokens"] is None and inputs._data_settings(_cfg(tmp_path, tokens=["<x>"]))["tokens"] == ["<x>"]
