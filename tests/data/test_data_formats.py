"""datasets: entries in every format, mixed: EOS after each document, only responses trained
for alpaca / chat data, pre-tokenized files memory-mapped, held-out documents, unpacked rows,
and no silent truncation."""
import json

import numpy as np
import pytest

from functional_pp.app.inputs import load_data
from functional_pp.config import DatasetConfig, TrainConfig
from functional_pp.data import DataLoader
from functional_pp.data.formats import ALPACA_PROMPT_NO_INPUT, ByteTokenizer, build_streams

BYTES = ByteTokenizer()
EOS = BYTES.eos_id


def _docs(stream):
    """The documents of a stream (split at EOS) as text, with their trained flags."""
    toks = np.asarray(stream.tokens)
    trained = np.ones(len(toks), np.uint8) if stream.trained is None else stream.trained
    ends = np.flatnonzero(toks == EOS)
    out, start = [], 0
    for e in ends:
        out.append((bytes(toks[start:e].tolist()).decode(), trained[start:e + 1].tolist()))
        start = e + 1
    return out


def test_mixed_entries_text_jsonl_alpaca_chat(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("first file")
    (tmp_path / "d" / "b.txt").write_text("second file")
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "a completion"}) + "\n")
    (tmp_path / "al.jsonl").write_text(json.dumps({"instruction": "Say hi", "input": "", "output": "hi"}) + "\n")
    chat = {"conversations": [{"from": "user", "value": "2+2?"}, {"from": "assistant", "value": "4"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    entries = [DatasetConfig(path=str(tmp_path / "d")), DatasetConfig(path=str(tmp_path / "c.jsonl"), field="body"),
               DatasetConfig(path=str(tmp_path / "al.jsonl"), type="alpaca"),
               DatasetConfig(path=str(tmp_path / "chat.jsonl"), type="chat_template",
                             field_messages="conversations", message_field_role="from",
                             message_field_content="value")]
    train, val = build_streams(entries, None, seq_len=16)
    assert val is None and train.documents == 5
    spilled = build_streams(entries, None, seq_len=16, spill_bytes=32)[0]          # on disk, mapped
    assert isinstance(spilled.trained, np.memmap) and spilled.trained.tolist() == train.trained.tolist()
    docs = _docs(train)
    assert [d[0] for d in docs[:3]] == ["first file", "second file", "a completion"]
    assert all(all(d[1]) for d in docs[:3])                      # plain text: every token trained
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi")
    text, flags = docs[3]
    assert text == prompt + "hi" and flags == [0] * len(prompt) + [1, 1, 1]   # "hi" + EOS
    text, flags = docs[4]                                        # ChatML, the documented default
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    trained = "".join(c for c, f in zip(text, flags) if f)
    # Axolotl's rule: the reply's content; bytes have no end-of-turn token, and the EOS that
    # separates documents is not a token the template wrote: untrained
    assert trained == "4" and flags[-1] == 0
    everything = build_streams(entries[2:3], None, seq_len=16, train_on_inputs=True)[0]
    assert everything.trained is None


def test_tokenizer_chat_template_is_used(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2, "U:": 3, "A:": 4,
                                                 "hi": 5, "yo": 6}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ 'U:' if m['role'] == 'user' else 'A:' }} {{ m['content'] }} {% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>",
                                                                "bos_token": "<s>", "add_bos_token": True}))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "yo"}]}) + "\n")
    from functional_pp.data.tokenizer import HFTokenizer
    hf = HFTokenizer(tmp_path)
    assert (hf.bos_id, hf.eos_id) == (1, 2)
    train, _ = build_streams([DatasetConfig(path=str(tmp_path / "chat.jsonl"), type="chat_template")], hf, seq_len=8)
    # as transformers' apply_chat_template: no BOS the template does not write; the EOS after
    # the conversation separates documents and is not trained (the template wrote none)
    assert train.tokens.tolist() == [3, 5, 4, 6, 2]             # U: hi A: yo </s>
    assert train.trained.tolist() == [0, 0, 0, 1, 0]


def test_pretokenized_files_are_memory_mapped_and_split_at_documents(tmp_path):
    ids = np.array([5, 6, 7, EOS, 8, 9, EOS, 10, 11, 12, 13, EOS, 14, 15, EOS], dtype=np.uint16)
    np.save(tmp_path / "t.npy", ids)
    ids.astype(np.uint32).tofile(tmp_path / "t.bin")
    for entry in (DatasetConfig(path=str(tmp_path / "t.npy")), DatasetConfig(path=str(tmp_path / "t.bin"), dtype="uint32")):
        train, val = build_streams([entry], None, seq_len=4, val_set_size=1)
        assert isinstance(train.tokens.base, np.memmap) or isinstance(train.tokens, np.memmap)
        assert train.tokens.tolist() == ids[:12].tolist() and val.tokens.tolist() == [14, 15, EOS]
        b = DataLoader(train, global_batch_size=1, seq_len=11, cp_balanced=False).global_batch(0)
        assert b["segments"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]


def test_held_out_examples_and_unpacked_rows(tmp_path):
    rows = [{"text": f"document number {i}"} for i in range(10)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    entry = DatasetConfig(path=str(tmp_path / "c.jsonl"))
    train, val = build_streams([entry], None, seq_len=32, val_set_size=0.2, seed=1)
    assert (train.documents, val.documents) == (8, 2)
    texts = sorted(d[0] for d in _docs(train) + _docs(val))
    assert texts == sorted(r["text"] for r in rows)              # a partition of the examples
    assert build_streams([entry], None, seq_len=32, val_set_size=0.2, seed=1)[1].tokens.tolist() == val.tokens.tolist()
    spilled, spilled_val = build_streams([entry], None, seq_len=32, val_set_size=0.2, seed=1, spill_bytes=64)
    assert isinstance(spilled.tokens, np.memmap) and isinstance(spilled.trained, type(None))
    assert spilled.tokens.tolist() == train.tokens.tolist() and spilled_val.tokens.tolist() == val.tokens.tolist()
    rows_only, _ = build_streams([entry], None, seq_len=32, sample_packing=False)
    loader = DataLoader(rows_only, global_batch_size=10, seq_len=32)
    assert loader.num_windows == 10 and loader._slack == 0
    b = loader.global_batch(0)
    for row, labels, segs in zip(b["tokens"], b["labels"], b["segments"]):
        text = bytes(row[row != EOS].tolist()).decode()
        assert text.startswith("document number ") and segs[0] == 0
        n = len(text)
        assert (labels[:n] != -100).all() and labels[n - 1] == EOS and (labels[n:] == -100).all()


def test_no_silent_truncation_of_a_large_corpus(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * (9 * 1024 * 1024))                   # over the old 8 MiB cap
    cfg = TrainConfig.from_dict({"data": {"path": str(big)}})
    assert len(load_data(cfg).train) == 9 * 1024 * 1024


def test_parquet_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"instruction": ["a", "b"], "input": ["", ""], "output": ["x", "y"]}),
                   tmp_path / "d.parquet")
    train, _ = build_streams([DatasetConfig(path=str(tmp_path / "d.parquet"), type="alpaca")], None, seq_len=8)
    assert train.documents == 2 and [d[0][-1] for d in _docs(train)] == ["x", "y"]


def test_hf_datasets_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"text": "one doc"}, {"text": "two doc"}])
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    ds.save_to_disk(str(tmp_path / "d"))
    for path in ("dd", "d"):
        train, _ = build_streams([DatasetConfig(path=str(tmp_path / path))], None, seq_len=8)
        assert [d[0] for d in _docs(train)] == ["one doc", "two doc"]
    with pytest.raises(ValueError, match=r"has splits \['train'\], not 'test'; set split"):
        build_streams([DatasetConfig(path=str(tmp_path / "dd"), split="test")], None, seq_len=8)


@pytest.mark.parametrize("record, entry, message", [
    ({"instruction": "x"}, {"type": "alpaca"}, "datasets[0]: record 1 has no field 'output' (it has ['instruction'])"),
    ({"txt": "x"}, {}, "datasets[0]: record 1 has no field 'text' (it has ['txt'])"),
    ({"text": 3}, {}, "datasets[0]: record 1: field 'text' is int, not text"),
    ({"messages": "hi"}, {"type": "chat_template"}, "'messages' must be a list of messages"),
    ({"text": "x"}, {"type": "sharegpt"}, "datasets[0].type 'sharegpt' is not supported (choose text, completion"),
])
def test_bad_records_are_named_with_their_place(tmp_path, record, entry, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    cfg = TrainConfig.from_dict({"datasets": [{"path": str(path), **entry}]})
    from functional_pp.config import ConfigError
    with pytest.raises(ConfigError) as info:
        load_data(cfg)
    assert message.replace("datasets[0]:", f"datasets[0] ({path}):") in str(info.value)     # the file named


@pytest.mark.parametrize("style, prompt", [
    ("alpaca:chat", "SYSTEM: Below is an instruction that describes a task, paired with an input that provides "
                    "further context. Write a response that appropriately completes the request.\n"
                    "USER: Add\n1 and 2\nASSISTANT:"),
    ("alpaca:phi", "<|system|>\nBelow is an instruction that describes a task, paired with an input that provides "
                   "further context. Write a response that appropriately completes the request.<|end|>\n"
                   "<|user|>\nAdd<|end|>1 and 2<|assistant|>"),
    ("alpaca:chatml", "<|im_start|>system\nBelow is an instruction that describes a task, paired with an input that "
                      "provides further context. Write a response that appropriately completes the request."
                      "<|im_end|>\n<|im_start|>user\nAdd\n1 and 2<|im_end|>\n<|im_start|>assistant\n"),
])
def test_alpaca_prompt_styles_train_the_output(tmp_path, style, prompt):
    """Axolotl's alpaca:chat / alpaca:phi / alpaca:chatml prompts (prompters.py's formats)."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"instruction": "Add", "input": "1 and 2", "output": "3"}) + "\n")
    train, _ = build_streams([DatasetConfig(path=str(tmp_path / "a.jsonl"), type=style)], None, seq_len=16)
    (text, flags), = _docs(train)
    assert text == prompt + "3" and flags == [0] * len(prompt.encode()) + [1, 1]        # "3" + EOS


def test_input_output_trains_the_labelled_segments(tmp_path):
    row = {"segments": [{"label": False, "text": "<q>what?</q>"}, {"label": True, "text": "this."},
                        {"label": False, "text": "!"}]}
    (tmp_path / "io.jsonl").write_text(json.dumps(row) + "\n")
    train, _ = build_streams([DatasetConfig(path=str(tmp_path / "io.jsonl"), type="input_output")], None,
                             seq_len=16)
    (text, flags), = _docs(train)
    assert text == "<q>what?</q>this.!" and flags == [0] * 12 + [1] * 5 + [0, 0]     # the EOS: untrained
    (tmp_path / "bad.jsonl").write_text(json.dumps({"segments": "x"}) + "\n")
    with pytest.raises(ValueError, match="segments must be a list of"):
        build_streams([DatasetConfig(path=str(tmp_path / "bad.jsonl"), type="input_output")], None, seq_len=16)


def test_excess_length_strategy_drops_truncates_or_refuses_long_rows(tmp_path):
    rows = [{"text": "short"}, {"text": "a much longer row of text"}, {"text": "tiny"}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    entry = [DatasetConfig(path=str(tmp_path / "c.jsonl"))]
    dropped, _ = build_streams(entry, None, seq_len=10, excess_length_strategy="drop")
    assert [d[0] for d in _docs(dropped)] == ["short", "tiny"] and dropped.stats[0].dropped == 1
    assert "1 rows longer than sequence_len=10 dropped" in dropped.stats[0].line()
    cut, _ = build_streams(entry, None, seq_len=10, excess_length_strategy="truncate")
    assert [d[0] for d in _docs(cut)] == ["short", "a much lo", "tiny"] and cut.stats[0].truncated == 1
    with pytest.raises(ValueError, match=r"record 2 has 26 tokens \(with EOS\), more than sequence_len=10"):
        build_streams(entry, None, seq_len=10, excess_length_strategy="raise")
    packed, _ = build_streams(entry, None, seq_len=10)            # unset: packed documents run on
    assert [d[0] for d in _docs(packed)][1] == "a much longer row of text"
    with pytest.raises(ValueError, match="all 3 rows are longer than sequence_len=3"):
        build_streams(entry, None, seq_len=3, excess_length_strategy="drop")
