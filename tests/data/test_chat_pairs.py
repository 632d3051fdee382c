"""Axolotl's ``chat_template.*`` preference types (functional_pp/data/chat_pairs.py), read from the
corpus's DPO config as written (tests/data/axolotl_examples/corpus/, Apache-2.0): the texts
Axolotl's strategy writes (its steps, rendered by transformers' ``apply_chat_template``), then
TRL 1.16's own tokenization and collation (``DPOTrainer._prepare_dataset`` with Axolotl's
doubled-BOS fix, ``DataCollatorForPreference``) equal our rows token for token: the prompt
masked, each completion trained. Bad records are refused naming the record and the key."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from axolotl_corpus import CORPUS
from chat_tokenizer import make_bpe_tokenizer, make_tokenizer

from functional_pp.config.sections import DatasetConfig
from functional_pp.data.chat import template_text
from functional_pp.data.pairs import build_pairs, pair_rows

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from trl.trainer import dpo_trainer  # noqa: E402

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
CONFIG = "llama-3/instruct-dpo-lora-8b.yml"
RECORDS = [
    {"conversation": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}],
     "chosen": {"role": "assistant", "content": "It is 2."}, "rejected": {"role": "assistant", "content": "3?"}},
    {"conversation": [{"role": "user", "content": "Name a colour."}],
     "chosen": "Blue, like the sky.",                                           # a text: the assistant's
     "rejected": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "No."}]},
    {"conversation": "Say hello.",                                              # one text: a user turn
     "chosen": {"role": "assistant", "content": "Hello there!"}, "rejected": {"role": "assistant", "content": "Bye"}},
]


def _entry(path) -> dict:
    """The config's dataset entry as written, its path local."""
    entry = dict(yaml.safe_load((CORPUS / CONFIG).read_text())["datasets"][0])
    assert entry["type"] == "chat_template.default" and entry["field_messages"] == "conversation"
    return {**entry, "path": str(path)}


def _tokenizers(tmp_path, kind: str, eos: str):
    """(ours, transformers') of one tokenizer that adds BOS (its post-processor, as Llama's)."""
    from tokenizers import Tokenizer, processors
    d = tmp_path / kind
    if kind == "bytes":
        make_tokenizer(d, BOS, eos)
    else:                    # merges across the places where a template's header meets a message
        texts = [json.dumps(r) for r in RECORDS] * 20 + ["assistant\n\nIt is Blue Hello yes yeah Blush"] * 20
        make_bpe_tokenizer(d, BOS, eos, texts)
    t = Tokenizer.from_file(str(d / "tokenizer.json"))
    t.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, t.token_to_id(BOS))])
    t.save(str(d / "tokenizer.json"))
    from functional_pp.data.tokenizer import HFTokenizer
    hf = transformers.AutoTokenizer.from_pretrained(d)
    assert hf("x").input_ids[0] == hf.bos_token_id
    return HFTokenizer(d), hf


def _axolotl_texts(rec: dict, entry: dict, hf, template: str) -> dict:
    """Axolotl's ``chat_template.default`` transform, step by step, rendered by transformers."""
    props, roles = entry["message_property_mappings"], entry["roles"]
    role_map = {s: t for t, sources in roles.items() for s in sources}
    msgs = rec[entry["field_messages"]]
    if isinstance(msgs, str):
        msgs = [{props["role"]: "user", props["content"]: msgs}]
    msgs = [{"role": role_map[m[props["role"]]], "content": m[props["content"]]} for m in msgs]
    out = {"prompt": hf.apply_chat_template(msgs, add_generation_prompt=True, chat_template=template, tokenize=False)}
    for side in ("chosen", "rejected"):
        raw = rec[entry[f"field_{side}"]]
        m = {props["role"]: "assistant", props["content"]: raw} if isinstance(raw, str) else \
            raw if isinstance(raw, dict) else raw[-1]
        m = {"role": role_map[m[props["role"]]], "content": m[props["content"]]}
        text = hf.apply_chat_template([{"role": "user", "content": "[[dummy_message]]"}, m],
                                      add_generation_prompt=False, chat_template=template, tokenize=False)
        out[side] = text[text.find(m["content"]):].rstrip()
    return out


def _trl_batch(hf, texts: list[dict], monkeypatch) -> dict:
    """TRL 1.16's tokenization (Axolotl's trainer making a doubled BOS one) and collation."""
    plain = dpo_trainer._tokenize

    def axolotl_tokenize(processing_class, input, **kw):
        out = plain(processing_class, input, **kw)
        ids = out["input_ids"]
        if ids[:2] == [hf.bos_token_id] * 2:
            out["input_ids"] = ids[1:]
        return out
    monkeypatch.setattr(dpo_trainer, "_tokenize", axolotl_tokenize)
    shell = dpo_trainer.DPOTrainer.__new__(dpo_trainer.DPOTrainer)
    shell._tokenizer = hf
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    ds = dpo_trainer.DPOTrainer._prepare_dataset(shell, datasets.Dataset.from_list(texts), hf, args, "train")
    rows = [{k: ex[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for ex in ds]
    return dpo_trainer.DataCollatorForPreference(pad_token_id=hf.eos_token_id)(rows)


@pytest.mark.parametrize("kind,template,eos", [("bytes", "llama3", EOT), ("bpe", "llama3", EOT),
                                                ("bpe", "chatml", "<|im_end|>"),
                                                ("bytes", "llama3", "<|end_of_text|>")])
def test_chat_template_pairs_equal_trl_tokenization(tmp_path, monkeypatch, kind, template, eos):
    ours, hf = _tokenizers(tmp_path, kind, eos)
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    entry = _entry(f)
    texts = [_axolotl_texts(r, entry, hf, template_text(template)) for r in RECORDS]
    want = _trl_batch(hf, texts, monkeypatch)
    pairs = build_pairs([DatasetConfig(**entry)], ours, seq_len=128, chat_template=template)
    n, seq = len(RECORDS), 128
    assert len(pairs) == n
    for i, pair in enumerate(pairs.pairs):
        rows = pair_rows(pair, seq, pairs.pad_id)
        for j, side in ((i, "chosen"), (n + i, "rejected")):
            length = int(want["attention_mask"][j].sum())
            tokens = rows[f"{side}_tokens"]
            assert tokens[:length].tolist() == want["input_ids"][j, :length].tolist(), (i, side)
            assert (tokens[length:] == pairs.pad_id).all()
            trained = torch.zeros(seq, dtype=torch.long)
            trained[1:] = torch.from_numpy(rows[f"{side}_labels"][:-1] != -100).long()
            assert trained[:length].tolist() == want["completion_mask"][j, :length].tolist(), (i, side)
            assert trained[length:].sum() == 0
    # one BOS, the prompt the template's with the generation prompt, each completion its end of turn
    first = pairs.pairs[0]
    assert first.prompt.count(ours.bos_id) == 1 and first.prompt[0] == ours.bos_id
    assert ours.decode(first.chosen, skip_special_tokens=False).startswith("It is 2.")
    if eos == "<|end_of_text|>":           # the tokenizer's EOS added after the template's end of turn
        assert ours.decode(first.chosen[-2:], skip_special_tokens=False) == EOT + eos


def test_argilla_chat_takes_the_prompt_from_the_chosen_conversation(tmp_path):
    ours, _ = _tokenizers(tmp_path, "bytes", "<|im_end|>")
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps({"chosen": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
                             "rejected": [{"role": "user", "content": "Hi?"},
                                          {"role": "assistant", "content": "Go away."}]}) + "\n")
    pairs = build_pairs([DatasetConfig(path=str(f), type="chat_template.argilla_chat")], ours, seq_len=128,
                        chat_template="chatml")
    p = pairs.pairs[0]
    text = ours.decode(p.prompt, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    assert ours.decode(p.chosen, skip_special_tokens=False) == "Hello.<|im_end|>"
    assert ours.decode(p.rejected, skip_special_tokens=False) == "Go away.<|im_end|>"


@pytest.mark.parametrize("rec,over,message", [
    ({"conversation": [{"role": "human", "content": "q"}], "chosen": "a", "rejected": "b"}, {},
     r"record 1: field 'conversation': message 1 has role 'human', which roles does not map .* add it to roles"),
    ({"conversation": [{"role": "user", "content": "q"}], "chosen": "a"}, {},
     r"record 1: no field 'rejected' .*; set field_rejected"),
    ({"conversation": [{"from": "user", "value": "q"}], "chosen": "a", "rejected": "b"}, {},
     r"record 1: field 'conversation': message 1 has no 'role' .*set message_property_mappings.role"),
    ({"messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}, {},
     r"record 1: no field 'conversation' .*; set field_messages"),
    ({"conversation": [{"role": "user", "content": "q"}], "chosen": {"role": "assistant", "content": 3},
      "rejected": "b"}, {}, r"record 1: field 'chosen': content is 3, not text"),
    ({"conversation": [{"role": "user", "content": "q"}], "chosen": "trailing space ", "rejected": "b"},
     {"chat_template": "llama3"}, r"record 1: field 'chosen': the chat template does not write the reply"),
])
def test_bad_chat_pairs_are_refused_naming_the_record_and_key(tmp_path, rec, over, message):
    ours, _ = _tokenizers(tmp_path, "bytes", EOT)
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"datasets\[0\]: .*bad.jsonl: " + message):
        build_pairs([DatasetConfig(**_entry(f))], ours, seq_len=128, **{"chat_template": "chatml", **over})


def test_plain_pairs_whose_tokens_merge_across_the_prompt_end_equal_trl(tmp_path, monkeypatch):
    """The completion starts where the prompt's tokens and the whole sequence's part (TRL's
    common prefix), not after the prompt tokenized alone."""
    ours, hf = _tokenizers(tmp_path, "bpe", EOT)
    recs = [{"prompt": "The answer is ye", "chosen": "s, surely.", "rejected": "ah, no."},
            {"prompt": "Blu", "chosen": "e sky", "rejected": "sh"}]
    f = tmp_path / "plain.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    want = _trl_batch(hf, recs, monkeypatch)
    pairs = build_pairs([DatasetConfig(path=str(f))], ours, seq_len=64)
    merged = 0
    for i, pair in enumerate(pairs.pairs):
        merged += len(pair.prompt) < len(ours.encode(recs[i]["prompt"])) + 1
        for j, side in ((i, "chosen"), (len(recs) + i, "rejected")):
            rows = pair_rows(pair, 64, pairs.pad_id)
            length = int(want["attention_mask"][j].sum())
            assert rows[f"{side}_tokens"][:length].tolist() == want["input_ids"][j, :length].tolist()
            trained = (rows[f"{side}_labels"][:length - 1] != -100).astype(int).tolist()
            assert trained == want["completion_mask"][j, 1:length].tolist(), (i, side)
    assert merged                         # a prompt's last token merged with its completion
