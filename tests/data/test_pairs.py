"""Preference pairs (functional_pp/data/pairs.py, pair_loader.py): Axolotl's chatml.* types as its
prompt strategies write them, rows whose labels train the completion only, the loader's device
blocks equal to the global batch cut by the layout, and bad records refused by name."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from functional_pp.config.sections import DatasetConfig
from functional_pp.data.formats import ByteTokenizer
from functional_pp.data.pair_loader import PairLoader
from functional_pp.data.pairs import build_pairs, pair_rows, pair_texts, tokenize_pair

IM = "<|im_start|>"


def _entry(kind=None, **kw):
    return SimpleNamespace(type=kind, field_prompt="prompt", field_chosen="chosen", field_rejected="rejected", **kw)


@pytest.mark.parametrize("kind,rec,prompt_text", [
    ("chatml.intel", {"question": "Q?", "chosen": "good", "rejected": "bad", "system": "S"},
     f"{IM}system\nS<|im_end|>\n{IM}user\nQ?<|im_end|>\n{IM}assistant\n"),
    ("chatml.argilla", {"instruction": "Q?", "chosen_response": "good", "rejected_response": "bad"},
     f"{IM}user\nQ?<|im_end|>\n{IM}assistant\n"),
    ("chatml.ultra", {"prompt": "Q?", "chosen": [{"content": "Q?"}, {"content": "good"}],
                      "rejected": [{"content": "Q?"}, {"content": "bad"}]},
     f"{IM}user\nQ?<|im_end|>\n{IM}assistant\n"),
    ("chatml.argilla_chat", {"chosen": [{"content": "Q?"}, {"content": "good"}],
                             "rejected": [{"content": "Q?"}, {"content": "bad"}]},
     f"{IM}user\nQ?<|im_end|>\n{IM}assistant\n"),
])
def test_chatml_types_write_axolotls_prompt(kind, rec, prompt_text):
    assert pair_texts(rec, _entry(kind), "d", 1) == (prompt_text, "good<|im_end|>", "bad<|im_end|>")


def test_plain_fields_and_rows_train_the_completion_only():
    rec = {"p": "ab", "c": "xyz", "r": "q"}
    texts = pair_texts(rec, SimpleNamespace(type=None, field_prompt="p", field_chosen="c", field_rejected="r"), "d", 1)
    pair = tokenize_pair(ByteTokenizer(), *texts)
    assert pair.chosen == [*b"xyz", 0] and pair.rejected == [*b"q", 0]        # EOS (byte 0) appended
    rows = pair_rows(pair, 8, pad_id=0)
    assert rows["chosen_tokens"].tolist() == [*b"abxyz", 0, 0, 0]
    # the label of position t is token t+1 where that is a completion token
    assert rows["chosen_labels"].tolist() == [-100, *b"xyz", 0, -100, -100, -100]
    assert rows["rejected_labels"].tolist() == [-100, ord("q"), 0, -100, -100, -100, -100, -100]
    assert rows["chosen_lm_labels"].tolist() == [*b"bxyz", 0, -100, -100, -100]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_loader_blocks_are_the_global_batch_cut_by_the_layout(tmp_path):
    recs = [{"prompt": f"p{i}", "chosen": "c" * (i % 4 + 1), "rejected": "r"} for i in range(12)]
    pairs = build_pairs([DatasetConfig(path=str(_write(tmp_path / "p.jsonl", recs)))], None, seq_len=8)
    full = PairLoader(pairs, global_batch_size=4, seq_len=8, seed=3)
    assert len(full) == 3
    for step in (0, 4):                      # the second epoch: another permutation
        g = full.global_batch(step)
        parts = [PairLoader(pairs, global_batch_size=4, seq_len=8, seed=3, dp_rank=r, dp_size=2, cp_rank=c,
                            cp_size=2).batch(step) for r in range(2) for c in range(2)]
        for k, v in g.items():
            rows = [torch.cat([parts[2 * r][k], parts[2 * r + 1][k]], 1) for r in range(2)]
            # cp (balanced): rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2
            whole = torch.cat(rows)[:, [0, 1, 4, 5, 6, 7, 2, 3]]
            assert torch.equal(whole, g[k]), k
    assert not np.array_equal(full.pair_indices(0), full.pair_indices(3))


def test_bad_records_and_lengths_are_refused_by_name(tmp_path):
    f = _write(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "c", "rejected": None}])
    with pytest.raises(ValueError, match=r"bad.jsonl: record 1: field 'rejected' is null, not text"):
        build_pairs([DatasetConfig(path=str(f))], None, seq_len=8)
    g = _write(tmp_path / "empty.jsonl", [{"prompt": "p", "chosen": "", "rejected": "r"}])
    with pytest.raises(ValueError, match="record 1: the chosen completion is empty"):
        build_pairs([DatasetConfig(path=str(g))], None, seq_len=8)
    h = _write(tmp_path / "long.jsonl", [{"prompt": "p" * 9, "chosen": "c", "rejected": "r"}])
    with pytest.raises(ValueError, match=r"no preference pair of long.jsonl fits sequence_len 8 \(the shortest needs "
                                         r"11 tokens\): raise sequence_len"):
        build_pairs([DatasetConfig(path=str(h))], None, seq_len=8)
    with pytest.raises(ValueError, match=r"argilla_chat.*record 1: field 'chosen' must be a list of messages"):
        pair_texts({"chosen": "x", "rejected": "y"}, _entry("chatml.argilla_chat"), "argilla_chat", 1)


def test_exact_duplicates_are_left_out_and_counted_when_asked(tmp_path):
    recs = [{"prompt": "p", "chosen": "c", "rejected": "r"}, {"prompt": "p", "chosen": "c", "rejected": "x"}]
    f = _write(tmp_path / "a.jsonl", recs * 3)
    entries = [DatasetConfig(path=str(f)), DatasetConfig(path=str(f))]           # (Axolotl's example: twice)
    kept = build_pairs(entries, None, seq_len=8, deduplicate=True)
    assert len(kept) == 2 and kept.duplicates == 10
    assert [p.rejected for p in kept.pairs] == [[*b"r", 0], [*b"x", 0]]
    assert len(build_pairs(entries, None, seq_len=8)) == 12
