"""Pretokenized ``.bin`` files read at the width they were written with (issue 46): uint32 ids
read as uint16 (the default) used to train twice the tokens, every second one id 0, silently;
a wrong width, a cut file or ids outside the vocabulary are refused naming the file and the fix."""
import numpy as np
import pytest

from functional_pp.config import DatasetConfig
from functional_pp.data.formats import ByteTokenizer, build_streams
from functional_pp.data.pretokenized import token_ids

EOS = ByteTokenizer.eos_id
IDS = np.array([5, 6, 7, EOS, 8, 9, EOS, 10, 11, 12, 13, EOS, 14, 15, 255, EOS])


def _streams(path, dtype=None, tokenizer=ByteTokenizer()):
    return build_streams([DatasetConfig(path=str(path), dtype=dtype)], tokenizer, seq_len=4)[0]


@pytest.mark.parametrize("written, read, message", [
    ("uint32", None, "every second 16-bit token of .*t.bin is 0, as in uint32 ids read as uint16: set dtype: uint32"),
    ("uint32", "uint16", "every second 16-bit token"),
    ("uint16", "uint32", "token 0 of .*t.bin is id 393221, outside the tokenizer's vocabulary of 256"),
    ("uint16", "int32", "outside the tokenizer's vocabulary of 256: the file was written with another dtype"),
])
def test_a_bin_read_at_the_wrong_width_is_refused(tmp_path, written, read, message):
    IDS.astype(written).tofile(tmp_path / "t.bin")
    with pytest.raises(ValueError, match=f"datasets\\[0\\] .*{message}"):
        _streams(tmp_path / "t.bin", read)
    assert _streams(tmp_path / "t.bin", written).tokens.tolist() == IDS.tolist()


def test_a_cut_bin_is_refused_naming_its_size(tmp_path):
    (tmp_path / "t.bin").write_bytes(IDS.astype("uint32").tobytes()[:-1])
    with pytest.raises(ValueError, match="t.bin has 63 bytes, not a whole number of uint32 tokens"):
        _streams(tmp_path / "t.bin", "uint32")


def test_the_default_width_holds_the_vocabulary(tmp_path):
    """A tokenizer with more than 65,536 ids (Llama 3's 128,256) reads uint32 by default; uint16
    named for it is refused (it cannot hold the ids)."""
    big = np.array([70000, 5, 128255, 2], dtype=np.uint32)
    big.tofile(tmp_path / "t.bin")
    assert token_ids(DatasetConfig(path=str(tmp_path / "t.bin")), 128256, "d").tolist() == big.tolist()
    with pytest.raises(ValueError, match="dtype uint16 cannot hold the ids of the tokenizer's 128256-token vocab"):
        token_ids(DatasetConfig(path=str(tmp_path / "t.bin"), dtype="uint16"), 128256, "d")
    assert token_ids(DatasetConfig(path=str(tmp_path / "t.bin"), dtype="uint32"), 128256, "d").dtype == np.uint32


def test_without_a_tokenizer_the_ids_are_not_bounded_by_the_byte_vocabulary(tmp_path):
    """No tokenizer given: the model's vocabulary bounds the ids (checked at the step), not the
    byte-level stand-in's 256; the width check still applies."""
    ids = np.array([5, 300, 50_000, EOS, 7, 8, 9, EOS])
    ids.astype("uint16").tofile(tmp_path / "t.bin")
    assert _streams(tmp_path / "t.bin", tokenizer=None).tokens.tolist() == ids.tolist()
    ids.astype("uint32").tofile(tmp_path / "t.bin")
    with pytest.raises(ValueError, match="every second 16-bit token"):
        _streams(tmp_path / "t.bin", tokenizer=None)
