"""Axolotl's ``llama3.*`` / ``chatml.*`` preference types and its user-defined type (a ``type:``
mapping) (functional_pp/data/pairs.py): the texts Axolotl's strategies write
(``prompt_strategies/dpo/llama3.py``, ``user_defined.py``, their f-strings copied here), then TRL
1.16's tokenization and collation, equal our rows token for token; bad user-defined types and
records are refused by name, at config check and at read."""
from __future__ import annotations

import json

import pytest
from test_chat_pairs import _tokenizers, _trl_batch

from functional_pp.config.schema import ConfigError
from functional_pp.config.sections import DatasetConfig
from functional_pp.config.train_config import TrainConfig
from functional_pp.data.pairs import build_pairs, pair_rows, pair_texts

pytest.importorskip("trl")

H, E = "<|start_header_id|>", "<|end_header_id|>"
EOT = "<|eot_id|>"


def _l3_prompt(sample, key):
    """Axolotl's llama3.py prompt, as written there."""
    if "system" in sample and sample["system"]:
        return (f"{H}system{E}\n\n{sample['system']}{EOT}"
                f"{H}user{E}\n\n{sample[key]}{EOT}{H}assistant{E}\n\n")
    return f"{H}user{E}\n\n{sample[key]}{EOT}{H}assistant{E}\n\n"


def _axolotl_llama3(strategy: str, s: dict) -> dict:
    """Axolotl's ``dpo/llama3.py`` transform ``strategy`` of record ``s``."""
    if strategy == "argilla_chat":
        return {"prompt": f"{H}user{E}\n\n{s['chosen'][0]['content']}{EOT}{H}assistant{E}\n\n",
                "chosen": f"{s['chosen'][1]['content']}{EOT}", "rejected": f"{s['rejected'][1]['content']}{EOT}"}
    if strategy == "ultra":
        return {"prompt": _l3_prompt(s, "prompt"), "chosen": f"{s['chosen'][1]['content']}{EOT}",
                "rejected": f"{s['rejected'][1]['content']}{EOT}"}
    if strategy == "default":       # (our llama3.argilla too: Axolotl's older name of the same strategy)
        key = next((k for k in ("prompt", "input", "question") if k in s), "instruction")
        c = "chosen" if "chosen" in s else "chosen_response"
        r = "rejected" if "rejected" in s else "rejected_response"
        return {"prompt": _l3_prompt(s, key), "chosen": f"{s[c]}{EOT}", "rejected": f"{s[r]}{EOT}"}
    key = {"icr": "input", "intel": "question", "prompt_pairs": "prompt"}[strategy]
    return {"prompt": _l3_prompt(s, key), "chosen": f"{s['chosen']}{EOT}", "rejected": f"{s['rejected']}{EOT}"}


def _turns(user, a):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": a}]


CASES = {
    "intel": [{"system": "Be brief.", "question": "What is 1+1?", "chosen": "It is 2.", "rejected": "3?"},
              {"system": "", "question": "Name a colour.", "chosen": "Blue.", "rejected": "No."}],
    "icr": [{"system": "Be kind.", "input": "Say hello.", "chosen": "Hello there!", "rejected": "Bye"}],
    "prompt_pairs": [{"prompt": "Say hello.", "chosen": "Hello there!", "rejected": "Bye"}],
    "default": [{"instruction": "Name a colour.", "chosen_response": "Blue, like the sky.", "rejected_response": "No."},
                {"question": "What is 1+1?", "system": "S", "chosen": "It is 2.", "rejected": "3?"}],
    "argilla": [{"input": "Name a colour.", "chosen_response": "Blush.", "rejected_response": "No."}],
    "ultra": [{"prompt": "Say hello.", "chosen": _turns("Say hello.", "Hello there!"),
               "rejected": _turns("Say hello.", "Bye")}],
    "argilla_chat": [{"chosen": _turns("What is 1+1?", "It is 2."), "rejected": _turns("What is 1+1?", "3?")}],
}


def _check_rows(pairs, want, n, seq):
    for i, pair in enumerate(pairs.pairs):
        rows = pair_rows(pair, seq, pairs.pad_id)
        for j, side in ((i, "chosen"), (n + i, "rejected")):
            length = int(want["attention_mask"][j].sum())
            assert rows[f"{side}_tokens"][:length].tolist() == want["input_ids"][j, :length].tolist(), (i, side)
            assert (rows[f"{side}_tokens"][length:] == pairs.pad_id).all()
            trained = (rows[f"{side}_labels"][:length - 1] != -100).astype(int).tolist()
            assert trained == want["completion_mask"][j, 1:length].tolist(), (i, side)
            assert (rows[f"{side}_labels"][length - 1:] == -100).all()


@pytest.mark.parametrize("strategy", list(CASES))
def test_llama3_types_equal_axolotl_and_trl_tokenization(tmp_path, monkeypatch, strategy):
    ours, hf = _tokenizers(tmp_path, "bpe", EOT)
    recs = CASES[strategy]
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    texts = [_axolotl_llama3("default" if strategy == "argilla" else strategy, r) for r in recs]
    for n, (rec, text) in enumerate(zip(recs, texts), start=1):
        got = pair_texts(rec, DatasetConfig(path="x", type=f"llama3.{strategy}"), "d", n)
        assert got == (text["prompt"], text["chosen"], text["rejected"])
    pairs = build_pairs([DatasetConfig(path=str(f), type=f"llama3.{strategy}")], ours, seq_len=96)
    assert len(pairs) == len(recs)
    _check_rows(pairs, _trl_batch(hf, texts, monkeypatch), len(recs), 96)
    # one BOS (the tokenizer's), each completion ending in the end of turn (the tokenizer's EOS)
    assert pairs.pairs[0].prompt.count(ours.bos_id) == 1
    assert ours.decode(pairs.pairs[0].chosen[-1:], skip_special_tokens=False) == EOT


def test_chatml_default_is_axolotls_default_strategy():
    rec = {"instruction": "Q?", "chosen_response": "good", "rejected_response": "bad", "system": "S"}
    got = pair_texts(rec, DatasetConfig(path="x", type="chatml.default"), "d", 1)
    assert got == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n",
                   "good<|im_end|>", "bad<|im_end|>")


def _axolotl_user_defined(spec: dict, sample: dict) -> dict:
    """Axolotl's ``dpo/user_defined.py`` ``default`` transform, as written there."""
    field_prompt = spec.get("field_prompt", "prompt")
    field_system = spec.get("field_system", "system")
    field_chosen = spec.get("field_chosen", "chosen")
    field_rejected = spec.get("field_rejected", "rejected")
    prompt_format = spec.get("prompt_format") or "{prompt}"
    chosen_format = spec.get("chosen_format") or "{chosen}"
    rejected_format = spec.get("rejected_format") or "{rejected}"
    if "{system}" in prompt_format:
        prompt = prompt_format.format(system=sample.get(field_system) or "", prompt=sample[field_prompt])
    else:
        prompt = prompt_format.format(prompt=sample[field_prompt])
    return {"prompt": prompt, "chosen": chosen_format.format(chosen=sample[field_chosen]),
            "rejected": rejected_format.format(rejected=sample[field_rejected])}


USER_SPECS = [
    {"field_prompt": "q", "field_system": "sys", "field_chosen": "good", "field_rejected": "bad",
     "prompt_format": "[{system}] Question: {prompt}\nAnswer:", "chosen_format": " {chosen}",
     "rejected_format": " {rejected}"},
    {"field_prompt": "q", "field_chosen": "good", "field_rejected": "bad", "prompt_format": "Q: {prompt} A:"},
    {"field_prompt": "q", "field_chosen": "good", "field_rejected": "bad"},            # formats left out
]
USER_RECS = [{"q": "What is 1+1?", "sys": "Be brief.", "good": "2.", "bad": "3?"},
             {"q": "Name a colour.", "good": "Blue, like the sky.", "bad": "No."}]         # no system


@pytest.mark.parametrize("spec", USER_SPECS)
def test_user_defined_type_equals_axolotl_and_trl_tokenization(tmp_path, monkeypatch, spec):
    ours, hf = _tokenizers(tmp_path, "bpe", EOT)
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in USER_RECS))
    texts = [_axolotl_user_defined(spec, r) for r in USER_RECS]
    cfg = TrainConfig.from_dict({"rl": "dpo", "datasets": [{"path": str(f), "type": spec}]})
    entry = cfg.datasets[0]
    assert entry.type == spec
    for n, (rec, text) in enumerate(zip(USER_RECS, texts), start=1):
        assert pair_texts(rec, entry, "d", n) == (text["prompt"], text["chosen"], text["rejected"])
    pairs = build_pairs(cfg.datasets, ours, seq_len=96)
    _check_rows(pairs, _trl_batch(hf, texts, monkeypatch), len(USER_RECS), 96)


@pytest.mark.parametrize("spec,message", [
    ({"field_promt": "q"}, r"key 'field_promt' is not one of Axolotl's user-defined preference type \(field_prompt, "),
    ({"prompt_format": "{question}: {prompt}"}, r"prompt_format '\{question\}: \{prompt\}' names \{question\}; "
                                                r"it may name only \{prompt\} and \{system\}"),
    ({"chosen_format": "{prompt} {chosen}"}, r"chosen_format .* names \{prompt\}; it may name only \{chosen\}"),
    ({"prompt_format": "Answer:"}, r"prompt_format 'Answer:' does not name \{prompt\}"),
    ({"rejected_format": "{rejected"}, r"rejected_format '\{rejected' is not a format string"),
    ({"field_chosen": 3}, r"field_chosen must be text, got 3"),
])
def test_bad_user_defined_types_are_refused_by_name(tmp_path, spec, message):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}) + "\n")
    with pytest.raises(ConfigError, match=r"rl: dpo: datasets\[0\]\.type \(user-defined\): " + message):
        TrainConfig.from_dict({"rl": "dpo", "datasets": [{"path": str(f), "type": spec}]})
    with pytest.raises(ValueError, match=r"datasets\[0\]\.type \(user-defined\): " + message):
        build_pairs([DatasetConfig(path=str(f), type=spec)], None, seq_len=64)


def test_user_defined_records_and_other_methods_are_refused_by_name(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"q": "p", "chosen": "c", "rejected": "r", "system": 4}) + "\n")
    spec = {"field_prompt": "question"}
    with pytest.raises(ValueError, match=r"p.jsonl: record 1 has no field 'question' \(it has \['chosen', 'q'"):
        build_pairs([DatasetConfig(path=str(f), type=spec)], None, seq_len=64)
    with pytest.raises(ValueError, match=r"record 1: field 'system' is a int, not text"):
        build_pairs([DatasetConfig(path=str(f), type={"field_prompt": "q", "prompt_format": "{system}{prompt}"})],
                    None, seq_len=64)
    for rl in ("kto", None):
        with pytest.raises(ConfigError, match=r"datasets\[0\]\.type is a mapping \(Axolotl's user-defined preference "
                                            rf"type\), read by rl: dpo / ipo / orpo / simpo only \(this config has "
                                            rf"rl: {rl}\)"):
            TrainConfig.from_dict({**({"rl": rl} if rl else {}), "datasets": [{"path": str(f), "type": spec}]})
