"""Tests for functional_pp.data: corpora, sharding helpers and the loader."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from functional_pp.data import (IGNORE_INDEX, ByteCorpus, Corpus, DataLoader, TokenizerCorpus, balanced_chunk_indices,
                                load_corpus, shard_batch, shard_sequence, unshard_sequence)


@pytest.fixture(scope="module")
def stdlib_corpus() -> Corpus:
    return load_corpus(max_bytes=1 << 20)


@pytest.fixture(scope="module")
def small_tokens() -> np.ndarray:
    # Distinct-ish values so windows at different offsets differ.
    return (np.arange(5000, dtype=np.int64) * 7919) % 50021


def _batches_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------


def test_default_stdlib_corpus(stdlib_corpus):
    c = stdlib_corpus
    assert c.vocab_size == 256
    assert len(c) == 1 << 20  # the cap is reached: the stdlib is far bigger
    assert c.tokens.dtype == np.uint8
    assert "stdlib" in c.name
    text = ByteCorpus.decode(c.tokens[:200_000])
    assert "def " in text and "import " in text
    # many distinct byte values: it is real text, not padding
    assert len(np.unique(c.tokens)) > 60


def test_default_corpus_deterministic_and_full_size():
    a = load_corpus(max_bytes=4096)
    b = ByteCorpus(max_bytes=4096)
    assert np.array_equal(a.tokens, b.tokens)
    full = load_corpus()  # default cap (8 MiB)
    assert len(full) > 4 * (1 << 20)
    assert np.array_equal(full.tokens[:4096], a.tokens)


def test_txt_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("hello world\n", encoding="utf-8")
    c = load_corpus(str(p))
    assert c.vocab_size == 256
    assert bytes(c.tokens.tolist()) == b"hello world\n"
    assert ByteCorpus.decode(c.tokens) == "hello world\n"


def test_txt_directory_sorted_with_separator(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"BBB")
    (tmp_path / "a.txt").write_bytes(b"AA")
    (tmp_path / "sub" / "c.txt").write_bytes(b"C")
    (tmp_path / "ignored.md").write_bytes(b"nope")
    c = load_corpus(tmp_path)
    assert bytes(c.tokens.tolist()) == b"AA\x00BBB\x00C"
    capped = load_corpus(tmp_path, max_bytes=4)
    assert bytes(capped.tokens.tolist()) == b"AA\x00B"


def test_jsonl_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps({"text": "héllo"}) + "\n\n" + json.dumps({"text": "yo", "x": 1}) + "\n",
        encoding="utf-8",
    )
    c = load_corpus(p)
    assert bytes(c.tokens.tolist()) == "héllo".encode() + b"\x00yo"
    q = tmp_path / "e.jsonl"
    q.write_text(json.dumps({"body": "abc"}) + "\n", encoding="utf-8")
    assert bytes(load_corpus(q, text_field="body").tokens.tolist()) == b"abc"
    with pytest.raises(ValueError, match="'text'"):
        load_corpus(q)


def test_missing_and_empty(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_corpus(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(empty)
    with pytest.raises(ValueError, match="kind"):
        load_corpus(empty, kind="bogus")


def test_split():
    c = Corpus(np.arange(100, dtype=np.int64) % 256, 256, "x")
    train, val = c.split(0.1)
    assert len(train) == 90 and len(val) == 10
    assert np.array_equal(np.concatenate([train.tokens, val.tokens]), c.tokens)
    assert train.vocab_size == val.vocab_size == 256
    with pytest.raises(ValueError):
        c.split(1.0)


def test_tokenizer_corpus(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"text": "ab"}) + "\n",
                 encoding="utf-8")

    class FakeEnc:
        def __init__(self, ids):
            self.ids = ids

    class FakeTok:  # duck-typed tokenizers.Tokenizer
        def get_vocab_size(self, with_added_tokens=True):
            return 1000

        def encode(self, text, add_special_tokens=False):
            return FakeEnc([ord(ch) for ch in text])

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    c = TokenizerCorpus(p, FakeTok(), separator_id=999)
    assert c.vocab_size == 1000
    assert c.tokens.tolist() == [ord(ch) for ch in "hello"] + [999] + [ord("a"), ord("b")]
    assert c.decode(c.tokens[:5]) == "hello"
    assert load_corpus(p, tokenizer=FakeTok(), max_bytes=3).tokens.tolist() == [104, 101, 108]

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tokenizers"):
            load_corpus(p, tokenizer=str(tmp_path / "tokenizer.json"))


# ----------------------------------------------------------------------------
# Sharding helpers
# ----------------------------------------------------------------------------


def test_balanced_chunk_indices():
    assert balanced_chunk_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert balanced_chunk_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert balanced_chunk_indices(8, 2, 1, balanced=False).tolist() == [4, 5, 6, 7]
    assert balanced_chunk_indices(8, 1, 0).tolist() == list(range(8))
    idx = torch.cat([balanced_chunk_indices(16, 4, r) for r in range(4)])
    assert sorted(idx.tolist()) == list(range(16))
    assert balanced_chunk_indices(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert balanced_chunk_indices(16, 4, 3).tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_shard_unshard_roundtrip(cp, balanced):
    x = torch.arange(3 * 16 * 2).reshape(3, 16, 2)
    parts = [shard_sequence(x, 1, cp, r, balanced) for r in range(cp)]
    for r, part in enumerate(parts):
        idx = balanced_chunk_indices(16, cp, r, balanced)
        assert torch.equal(part, x[:, idx])
    assert torch.equal(unshard_sequence(parts, 1, balanced), x)
    assert torch.equal(unshard_sequence(parts, -2, balanced), x)


# ----------------------------------------------------------------------------
# Loader
# ----------------------------------------------------------------------------


def test_windows_are_next_token_pairs(small_tokens):
    dl = DataLoader(small_tokens, global_batch_size=4, seq_len=16, seed=3)
    b = dl.global_batch(5)
    starts = dl.window_starts(5)
    assert b["tokens"].dtype == torch.int64 and b["labels"].dtype == torch.int64
    assert b["tokens"].shape == (4, 16) and b["positions"].tolist() == list(range(16))
    for row, s in enumerate(starts):
        w = torch.from_numpy(small_tokens[s:s + 17])
        assert torch.equal(b["tokens"][row], w[:-1])
        assert torch.equal(b["labels"][row], w[1:])
    assert torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])
    assert not (b["labels"] == IGNORE_INDEX).any()


def test_determinism_from_seed(small_tokens):
    a = DataLoader(small_tokens, global_batch_size=4, seq_len=16, seed=1)
    b = DataLoader(torch.from_numpy(small_tokens), global_batch_size=4, seq_len=16, seed=1)
    c = DataLoader(small_tokens, global_batch_size=4, seq_len=16, seed=2)
    for _ in range(3):
        ba, bb, bc = next(a), next(b), next(c)
        assert _batches_equal(ba, bb)
        assert not torch.equal(ba["tokens"], bc["tokens"])
    # consecutive steps differ
    assert not torch.equal(a.global_batch(0)["tokens"], a.global_batch(1)["tokens"])


def test_epoch_covers_each_window_once(small_tokens):
    dl = DataLoader(small_tokens, global_batch_size=8, seq_len=50, seed=0)
    starts = np.concatenate([dl.window_starts(t) for t in range(len(dl))])
    assert len(starts) == len(np.unique(starts)) == len(dl) * 8
    assert np.all(np.diff(np.sort(starts)) % 50 == 0)
    assert starts.max() + 51 <= len(small_tokens)
    nxt = np.concatenate([dl.window_starts(len(dl) + t) for t in range(len(dl))])
    assert not np.array_equal(starts, nxt)  # next epoch: new permutation


def test_drop_last_false_wraps(small_tokens):
    toks = small_tokens[:101]  # exactly 10 windows of 10
    dl = DataLoader(toks, global_batch_size=4, seq_len=10, drop_last=False, num_epochs=1)
    batches = list(dl)
    assert len(batches) == len(dl) == 3
    starts = np.concatenate([dl.window_starts(t) for t in range(3)])
    assert set(starts.tolist()) == set(range(0, 100, 10))


@pytest.mark.parametrize("balanced", [True, False])
def test_global_batch_independent_of_mesh(small_tokens, balanced):
    B, S = 8, 16
    ref = DataLoader(small_tokens, global_batch_size=B, seq_len=S, seed=7).global_batch(3)
    for dp in (1, 2, 4):
        for cp in (1, 2, 4):
            loaders = {
                (d, c): DataLoader(small_tokens, global_batch_size=B, seq_len=S, seed=7,
                                   dp_rank=d, dp_size=dp, cp_rank=c, cp_size=cp,
                                   cp_balanced=balanced)
                for d in range(dp) for c in range(cp)
            }
            gb = loaders[(0, 0)].global_batch(3)
            assert _batches_equal(gb, ref)
            rows_tok, rows_lab = [], []
            for d in range(dp):
                parts = {(d, c): loaders[(d, c)].batch(3) for c in range(cp)}
                for c in range(cp):
                    local = parts[(d, c)]
                    assert local["tokens"].shape == (B // dp, S // cp)
                    assert _batches_equal(
                        local, shard_batch(ref, d, dp, c, cp, balanced)
                    )
                    assert torch.equal(
                        local["positions"], balanced_chunk_indices(S, cp, c, balanced)
                    )
                    # positions index the local tokens inside the full rows
                    rows = slice(d * B // dp, (d + 1) * B // dp)
                    assert torch.equal(
                        local["tokens"], ref["tokens"][rows][:, local["positions"]]
                    )
                rows_tok.append(unshard_sequence(
                    [parts[(d, c)]["tokens"] for c in range(cp)], 1, balanced))
                rows_lab.append(unshard_sequence(
                    [parts[(d, c)]["labels"] for c in range(cp)], 1, balanced))
                pos = unshard_sequence([parts[(d, c)]["positions"] for c in range(cp)], 0,
                                       balanced)
                assert pos.tolist() == list(range(S))
            assert torch.equal(torch.cat(rows_tok), ref["tokens"])
            assert torch.equal(torch.cat(rows_lab), ref["labels"])


def test_state_dict_roundtrip(small_tokens):
    kw = dict(global_batch_size=4, seq_len=16, seed=11)
    full = DataLoader(small_tokens, **kw)
    expected = [next(full) for _ in range(200)]  # crosses several epochs

    first = DataLoader(small_tokens, **kw)
    for _ in range(117):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["step"] == 117 and state["seed"] == 11
    assert state["epoch"] == 117 // len(first)

    resumed = DataLoader(small_tokens, global_batch_size=4, seq_len=16, seed=0)
    resumed.load_state_dict(state)
    for t in range(117, 200):
        assert _batches_equal(next(resumed), expected[t]), t

    # resuming under a different mesh gives the matching shard
    sharded = DataLoader(small_tokens, dp_rank=1, dp_size=2, cp_rank=1, cp_size=2, **kw)
    sharded.load_state_dict(state)
    assert _batches_equal(next(sharded), shard_batch(expected[117], 1, 2, 1, 2, True))

    with pytest.raises(ValueError, match="seq_len=16.*seq_len=32"):
        DataLoader(small_tokens, global_batch_size=4, seq_len=32).load_state_dict(state)


def test_num_epochs_stops(small_tokens):
    dl = DataLoader(small_tokens[:161], global_batch_size=2, seq_len=16, num_epochs=2)
    assert len(dl) == 5
    assert sum(1 for _ in dl) == 10


def test_error_messages_name_sizes(small_tokens):
    with pytest.raises(ValueError, match=r"global_batch_size=6.*dp_size=4"):
        DataLoader(small_tokens, global_batch_size=6, seq_len=16, dp_size=4)
    with pytest.raises(ValueError, match=r"seq_len=12.*2\*cp_size=8"):
        DataLoader(small_tokens, global_batch_size=4, seq_len=12, cp_size=4)
    with pytest.raises(ValueError, match=r"seq_len=10.*cp_size=4"):
        DataLoader(small_tokens, global_batch_size=4, seq_len=10, cp_size=4,
                   cp_balanced=False)
    # 12 is divisible by cp_size=4 unbalanced: fine
    DataLoader(small_tokens, global_batch_size=4, seq_len=12, cp_size=4, cp_balanced=False)
    with pytest.raises(ValueError, match=r"20 tokens.*seq_len\+1=33"):
        DataLoader(small_tokens[:20], global_batch_size=1, seq_len=32)
    with pytest.raises(ValueError, match=r"global_batch_size=8"):
        DataLoader(small_tokens[:65], global_batch_size=8, seq_len=16)
    with pytest.raises(ValueError, match=r"dp_rank"):
        DataLoader(small_tokens, global_batch_size=4, seq_len=16, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match=r"seq_len=6.*2\*cp_size=4"):
        shard_sequence(torch.zeros(2, 6), 1, 2, 0, True)


def test_loader_on_stdlib_corpus(stdlib_corpus):
    train, val = stdlib_corpus.split(0.05)
    dl = DataLoader(train, global_batch_size=4, seq_len=128, seed=0, cp_size=2, cp_rank=1)
    b = next(dl)
    assert b["tokens"].shape == (4, 64) and b["tokens"].max() < 256
    assert b["positions"].tolist() == list(range(32, 96))
    vl = DataLoader(val, global_batch_size=4, seq_len=128)
    assert vl.global_batch(0)["tokens"].shape == (4, 128)
