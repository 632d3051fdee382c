"""KTO's unpaired completions (functional_pp/data/unpaired.py): Axolotl's KTO chatml.* prompts,
and rows equal to TRL 1.16's own KTO tokenization and collation (``KTOTrainer._prepare_dataset``
with its KL completions, ``DataCollatorForUnpairedPreference``): the same tokens, the prompt
masked, the mismatched KL rows; bad labels and records refused naming the record and field."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from chat_tokenizer import make_bpe_tokenizer

from functional_pp.config.sections import DatasetConfig
from functional_pp.data.pair_loader import PairLoader
from functional_pp.data.unpaired import build_completions, completion_texts

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from trl.trainer import kto_trainer  # noqa: E402

IM = "<|im_start|>"
RECORDS = [{"question": "What is 1+1?", "completion": "It is 2.", "label": True, "system": "Be brief."},
           {"question": "Name a colour.", "completion": "No.", "label": False},
           {"question": "Say hello.", "completion": "Hello there, friend!", "label": True},
           {"question": "Is ice cold?", "completion": "Maybe not", "label": False}]


def test_chatml_kto_types_write_axolotls_prompt():
    entry = SimpleNamespace(type="chatml.intel", field_label="label")
    assert completion_texts(RECORDS[0], entry, "d", 1) == (
        f"{IM}system\nBe brief.<|im_end|>\n{IM}user\nWhat is 1+1?<|im_end|>\n{IM}assistant\n",
        "It is 2.<|im_end|>", True)
    chat = {"completion": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}],
            "label": False}
    assert completion_texts(chat, SimpleNamespace(type="chatml.argilla_chat", field_label="label"), "d", 1) == (
        f"{IM}user\nHi<|im_end|>\n{IM}assistant\n", "Hey<|im_end|>", False)


def test_kto_rows_equal_trl_tokenization_and_kl_completions(tmp_path):
    d = tmp_path / "tok"
    ours = make_bpe_tokenizer(d, None, "<|im_end|>", [json.dumps(r) for r in RECORDS] * 20)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    f = tmp_path / "kto.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    entry = DatasetConfig(path=str(f), type="chatml.intel")
    texts = [dict(zip(("prompt", "completion", "label"), completion_texts(r, entry, "d", n)))
             for n, r in enumerate(RECORDS, 1)]
    shell = kto_trainer.KTOTrainer.__new__(kto_trainer.KTOTrainer)
    shell.__dict__.update(_tokenizer=hf, calculate_KL=True, desirable_weight=1.0, undesirable_weight=1.0)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, per_device_train_batch_size=len(RECORDS))
    ds = kto_trainer.KTOTrainer._prepare_dataset(shell, datasets.Dataset.from_list(texts), hf, args, "train")
    want = kto_trainer.DataCollatorForUnpairedPreference(pad_token_id=hf.eos_token_id)(
        [{k: ex[k] for k in ("prompt_ids", "completion_ids", "KL_completion_ids", "label")} for ex in ds])
    found = build_completions([entry], ours, seq_len=64)
    rows = found.batch_rows(np.arange(len(RECORDS)), 64)        # the batch in dataset order, as TRL's
    for ours_key, trl_key in (("", ""), ("kl_", "KL_")):
        for i in range(len(RECORDS)):
            n = int(want[f"{trl_key}attention_mask"][i].sum())
            assert rows[f"{ours_key}tokens"][i, :n].tolist() == want[f"{trl_key}input_ids"][i, :n].tolist()
            assert (rows[f"{ours_key}tokens"][i, n:] == found.pad_id).all()
            trained = (rows[f"{ours_key}labels"][i, :n - 1] != -100).astype(int).tolist()
            assert trained == want[f"{trl_key}completion_mask"][i, 1:n].tolist(), (ours_key, i)
    assert rows["desirable"][:, 0].tolist() == want["label"].float().tolist()
    assert (rows["desirable"] == rows["desirable"][:, :1]).all()
    # the loader's batches: a step's rows, their KL rows the same step's completions rotated
    loader = PairLoader(found, global_batch_size=2, seq_len=64, seed=1)
    b, idx = loader.global_batch(1), loader.pair_indices(1)
    first = found.completions[idx[0]]
    kl = first.prompt + found.completions[idx[1]].completion
    assert b["kl_tokens"][0, :len(kl)].tolist() == kl


@pytest.mark.parametrize("rec,message", [
    ({"question": "q", "completion": "a", "label": "yes"},
     r"record 1: field 'label' is 'yes' \(str\), not true or false; .* give a boolean"),
    ({"question": "q", "completion": "a", "label": 1}, r"record 1: field 'label' is 1 \(int\), not true or false"),
    ({"question": "q", "completion": "a"}, r"record 1 has no field 'label'"),
    ({"question": "q", "label": True}, r"record 1 has no field 'completion'"),
])
def test_bad_kto_records_are_refused_naming_the_record_and_field(tmp_path, rec, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"datasets\[0\]: .*bad.jsonl: " + message):
        build_completions([DatasetConfig(path=str(f), type="chatml.intel")], None, seq_len=64)
