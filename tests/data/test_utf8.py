"""Every data file goes through one strict UTF-8 decoder (``data/utf8.py``, issue 46): bytes that
are not UTF-8 are refused naming the file, the line, the byte offset in the file and how to
convert it, for each kind of file the data path reads; plain text was decoded with
``errors="replace"`` and trained U+FFFD silently."""
import json

import pytest

from functional_pp.config import DatasetConfig
from functional_pp.data.corpus import TokenizerCorpus, load_corpus
from functional_pp.data.formats import build_streams
from functional_pp.data.utf8 import Utf8Error, decode

BAD = "caf\xe9 au lait".encode("latin-1")          # 0xe9 at byte 3 is not UTF-8


class CharTokenizer:
    """A ``tokenizers.Tokenizer`` stand-in: one id per character."""

    def get_vocab_size(self, with_added_tokens=True):
        return 0x110000

    def encode(self, text, add_special_tokens=False):
        return type("Enc", (), {"ids": [ord(c) for c in text]})()


def _text_dataset(tmp_path, body: bytes):
    (tmp_path / "a.txt").write_bytes(body)
    return build_streams([DatasetConfig(path=str(tmp_path / "a.txt"), type="text")], None, seq_len=64)


def _jsonl_dataset(tmp_path, body: bytes):
    (tmp_path / "a.jsonl").write_bytes(body)
    return build_streams([DatasetConfig(path=str(tmp_path / "a.jsonl"), type="completion")], None, seq_len=64)


def _json_array_dataset(tmp_path, body: bytes):
    (tmp_path / "a.json").write_bytes(body)
    return build_streams([DatasetConfig(path=str(tmp_path / "a.json"), type="completion")], None, seq_len=64)


def _corpus_text(tmp_path, body: bytes):
    (tmp_path / "a.txt").write_bytes(body)
    return TokenizerCorpus(tmp_path / "a.txt", CharTokenizer())


def _corpus_jsonl(tmp_path, body: bytes):
    (tmp_path / "a.jsonl").write_bytes(body)
    return load_corpus(tmp_path / "a.jsonl")


FIRST = b"one line\n"
CASES = [  # (reader, file contents, file name, line, byte offset of the bad byte in the file)
    (_text_dataset, FIRST + BAD + b"\n", "a.txt", 2, len(FIRST) + 3),
    (_jsonl_dataset, b'{"text": "ok"}\n{"text": "' + BAD + b'"}\n', "a.jsonl", 2, 15 + 10 + 3),
    (_json_array_dataset, b'[{"text": "ok"},\n {"text": "' + BAD + b'"}]\n', "a.json", 2, 17 + 11 + 3),
    (_corpus_text, FIRST + BAD, "a.txt", 2, len(FIRST) + 3),
    (_corpus_jsonl, b'{"text": "' + BAD + b'"}\n', "a.jsonl", 1, 10 + 3),
]


@pytest.mark.parametrize("read, body, name, line, offset", CASES, ids=[c[0].__name__ for c in CASES])
def test_bytes_that_are_not_utf8_are_refused_naming_file_line_and_offset(tmp_path, read, body, name, line, offset):
    with pytest.raises(Utf8Error) as e:
        read(tmp_path, body)
    msg = str(e.value)
    assert str(tmp_path / name) in msg and f"line {line}: not UTF-8 (byte 0xe9 at byte offset {offset} " in msg
    assert "convert the file to UTF-8" in msg and "iconv" in msg


def test_valid_text_reads_exactly(tmp_path):
    train, _ = _text_dataset(tmp_path, "caf\u00e9\n".encode())
    assert bytes(int(t) for t in train.tokens).decode().startswith("caf\u00e9")
    corpus = _corpus_text(tmp_path, "caf\u00e9".encode())
    assert "".join(chr(int(i)) for i in corpus.tokens) == "caf\u00e9"


def test_a_character_cut_by_max_bytes_is_dropped_not_refused(tmp_path):
    (tmp_path / "a.txt").write_bytes("ab\u00e9".encode())           # \u00e9 is 2 bytes: max_bytes=3 cuts it
    corpus = TokenizerCorpus(tmp_path / "a.txt", CharTokenizer(), max_bytes=3)
    assert "".join(chr(int(i)) for i in corpus.tokens) == "ab"


def test_a_chat_template_file_is_decoded_strictly(tmp_path):
    from functional_pp.data.chat import resolve_template
    (tmp_path / "t.jinja").write_bytes(b"{{ messages }}\n" + BAD)
    with pytest.raises(Utf8Error, match=f"{tmp_path / 't.jinja'}: line 2: not UTF-8"):
        resolve_template("jinja", str(tmp_path / "t.jinja"), None, "chat_template_jinja")


def test_the_record_is_named_where_there_is_no_line():
    with pytest.raises(Utf8Error, match="f.parquet: record 7: not UTF-8 .byte 0xe9 at byte offset 3 "):
        decode(BAD, "f.parquet", record=7)
    assert json.loads(decode(b'{"a": 1}', "x")) == {"a": 1}


def test_a_utf8_byte_order_mark_is_not_text_and_utf16_is_named(tmp_path):
    """Editors that save "UTF-8 with BOM" put EF BB BF first: JSON lines refused it as invalid JSON,
    plain text trained a U+FEFF token. A UTF-16 file is refused saying it is UTF-16."""
    train, _ = _jsonl_dataset(tmp_path, b'\xef\xbb\xbf{"text": "ok"}\n')
    assert bytes(int(t) for t in train.tokens).startswith(b"ok")
    train, _ = _text_dataset(tmp_path, b"\xef\xbb\xbfok\n")
    assert bytes(int(t) for t in train.tokens).startswith(b"ok")
    with pytest.raises(Utf8Error, match="line 1: not UTF-8 .byte 0xff at byte offset 0 .* the file is UTF-16"):
        _text_dataset(tmp_path, "ok\n".encode("utf-16"))
