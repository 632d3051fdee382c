"""Reward-model data (data/reward_data.py): bradley_terry.chat_template conversations tokenized as
transformers' apply_chat_template (Axolotl's ChatTemplateStrategy) writes them, cut to
sequence_len, scored at the last non-pad token; stepwise_supervised rows as TRL's
PRMTrainer.tokenize_row (Axolotl's copy): the separator's last token carries each step's label."""
import json

import numpy as np
import pytest
from chat_tokenizer import make_tokenizer

from functional_pp.config.sections import DatasetConfig
from functional_pp.data.chat import template_text
from functional_pp.data.formats import ByteTokenizer
from functional_pp.data.reward_data import build_scored_pairs, build_stepwise, last_token_mask, pad_id_of, stepwise_row

RECORDS = [{"system": "Be brief.", "input": "What is 2+2?", "chosen": "It is 4.", "rejected": "Five.", "margin": 1.5},
           {"system": "", "input": "Say hi.", "chosen": "Hi!", "rejected": "No."}]


def _write(tmp_path, rows, name="d.jsonl"):
    f = tmp_path / name
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_bradley_terry_pairs_are_transformers_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = make_tokenizer(tmp_path / "tok", None, "<|im_end|>")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok.file), eos_token="<|im_end|>")
    f = _write(tmp_path, RECORDS)
    pairs = build_scored_pairs([DatasetConfig(path=str(f), type="bradley_terry.chat_template")], tok, seq_len=200,
                               chat_template="qwen_25")
    assert len(pairs) == 2 and pairs.has_margin and pairs.pairs[0].margin == 1.5 and pairs.pairs[1].margin == 0.0
    for rec, pair in zip(RECORDS, pairs.pairs):
        for side in ("chosen", "rejected"):
            turns = ([{"role": "system", "content": rec["system"]}] if rec["system"] else []) + [
                {"role": "user", "content": rec["input"]}, {"role": "assistant", "content": rec[side]}]
            want = hf.apply_chat_template(turns, chat_template=template_text("qwen_25"), tokenize=True,
                                          return_dict=True)["input_ids"]
            assert getattr(pair, side) == want
    rows = pairs.batch_rows([0, 1], 200)
    pad = pad_id_of(tok)
    for side in ("chosen", "rejected"):
        n = [len(getattr(p, side)) for p in pairs.pairs]
        assert (rows[f"{side}_last"].argmax(-1) == np.array(n) - 1 - [getattr(p, side)[-1] == pad
                                                                       for p in pairs.pairs]).all()
    assert rows["margin"][0, 0] == 1.5 and (rows["pair_weight"] == 1).all()
    short = build_scored_pairs([DatasetConfig(path=str(f), type="bradley_terry.chat_template")], tok, seq_len=10,
                               chat_template="qwen_25")
    assert short.truncated == 4 and all(len(p.chosen) == 10 for p in short.pairs)     # cut, as Axolotl


def test_last_token_mask_is_transformers_rule():
    toks = np.array([[5, 6, 0, 0], [0, 7, 8, 9], [0, 0, 0, 0]])
    assert last_token_mask(toks, 0).argmax(-1).tolist() == [1, 3, 0]
    assert last_token_mask(toks, None).argmax(-1).tolist() == [3, 3, 3]


def test_stepwise_row_is_trl_tokenize_row(tmp_path):
    tok = ByteTokenizer()
    rec = {"prompt": "Q", "completions": ["ab", "c"], "labels": [True, False]}
    row = stepwise_row(tok, rec, step_separator="\n", seq_len=50, max_completion_length=None,
                       train_on_last_step_only=False, is_eval=False)
    assert row.tokens == [ord("Q"), ord("a"), ord("b"), 10, ord("c"), 10]
    assert row.labels == [-100, -100, -100, 1, -100, 0]
    last = stepwise_row(tok, rec, step_separator="\n", seq_len=50, max_completion_length=None,
                        train_on_last_step_only=True, is_eval=False)
    assert last.labels == [-100, -100, -100, -100, -100, 0]
    held = stepwise_row(tok, rec, step_separator="\n", seq_len=50, max_completion_length=None,
                        train_on_last_step_only=True, is_eval=True)
    assert held.labels == row.labels                       # (TRL's is_eval: every step)
    cut = stepwise_row(tok, rec, step_separator=" then ", seq_len=50, max_completion_length=4,
                       train_on_last_step_only=False, is_eval=False)
    assert len(cut.tokens) == 5 and cut.labels == [-100] * 5
    bos = make_tokenizer(tmp_path / "t", "<|begin_of_text|>", "<|eot_id|>")
    bos.bos_id = bos.token_to_id("<|begin_of_text|>")
    with_bos = stepwise_row(bos, rec, step_separator="\n", seq_len=50, max_completion_length=None,
                            train_on_last_step_only=False, is_eval=False)
    assert with_bos.tokens[0] == bos.bos_id and with_bos.labels[:2] == [-100, -100]


def test_stepwise_set_holds_out_every_label_and_refuses_bad_rows(tmp_path):
    rows = [{"prompt": f"P{i}", "completions": ["a", "b"], "labels": [1, 0]} for i in range(5)]
    f = _write(tmp_path, rows)
    entry = DatasetConfig(path=str(f), type="stepwise_supervised", step_separator="\n", train_on_last_step_only=True)
    data = build_stepwise([entry], ByteTokenizer(), seq_len=16)
    train, val = data.split(2, seed=0)
    assert len(train) == 3 and len(val) == 2
    assert all(sum(x != -100 for x in r.labels) == 1 for r in train.rows)
    assert all(sum(x != -100 for x in r.labels) == 2 for r in val.rows)
    batch = train.batch_rows([0, 1], 16, weights=[1, 0])
    assert (batch["labels"][1] == -100).all() and (batch["labels"][0] != -100).sum() == 1
    bad = _write(tmp_path, [{"prompt": "p", "completions": ["a", "b"], "labels": [1]}], "bad.jsonl")
    with pytest.raises(ValueError, match="one per step"):
        build_stepwise([DatasetConfig(path=str(bad), type="stepwise_supervised")], ByteTokenizer(), seq_len=16)
    with pytest.raises(ValueError, match="needs a text field 'input'"):
        build_scored_pairs([DatasetConfig(path=str(bad), type="bradley_terry.chat_template")], ByteTokenizer(),
                           seq_len=16)
