"""``tokenizer_use_mistral_common: true`` (Axolotl's mistral-common tokenizers, issue 47): the
tokenizer file (``tekken.json``) is read with the ``mistral-common`` package; a chat's tokens
equal mistral-common's own encoding of it (and transformers' ``MistralCommonBackend``, which
Axolotl's ``HFMistralTokenizer`` extends); the trained tokens are Axolotl's rule on them (each
reply and the EOS after it); the options Axolotl refuses beside it are refused; without the
package the run stops naming the extra. Tiny tokenizer files are built here (no hub)."""
import sys

import pytest
from chat_tokenizer import make_tekken

pytest.importorskip("mistral_common")

from functional_pp.config import ConfigError, DatasetConfig, TrainConfig  # noqa: E402
from functional_pp.data.chat import tokenize_chat  # noqa: E402
from functional_pp.data.formats import chat_spec  # noqa: E402
from functional_pp.data.mistral_tokenizer import MistralCommonTokenizer  # noqa: E402

CHAT = [{"role": "system", "content": "Be nice."},
        {"role": "user", "content": "What is this?"},
        {"role": "assistant", "content": "This is it."},
        {"role": "user", "content": "And that?"},
        {"role": "assistant", "content": "That is in."}]


def _ids_and_mask(tok, rec, **entry):
    spec = chat_spec(DatasetConfig(path="x", type="chat_template", **entry), tok, train_inputs=False,
                     default_template=None)
    return tokenize_chat(tok, rec, spec)


def _reference(hf, turns):
    """Axolotl's ChatTemplateStrategy / MistralStrategy (roles_to_train [assistant],
    train_on_eos turn, the end of turn its EOS), written on transformers' apply_chat_template of
    the mistral-common backend as Axolotl calls it."""
    def ids(ts):
        return list(hf.apply_chat_template(ts, tokenize=True, return_dict=True)["input_ids"])
    full = ids(turns)
    labels = [0] * len(full)
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        dummy, real = ids(turns[:i] + [{"role": "assistant", "content": "[[dummy_message]]"}]), ids(turns[:i + 1])
        n = min(len(dummy), len(real))
        start = next(j for j in range(n) if dummy[j] != real[j])
        end = next(len(real) - j for j in range(n) if dummy[-1 - j] != real[-1 - j])
        labels[start:end] = [1] * (end - start)
        eos = next((j for j in range(end, len(full)) if full[j] == hf.eos_token_id), -1)
        if eos != -1 and abs(eos - end) <= 3:
            labels[eos] = 1
    return full, labels


@pytest.mark.parametrize("version", ["v3", "v7", "v11", "v13"])
def test_chat_tokens_are_mistral_commons_and_the_replies_are_trained(tmp_path, version):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    f = make_tekken(tmp_path, version)
    tok = MistralCommonTokenizer(tmp_path)          # the directory: its tekken.json
    assert tok.file == f and tok.vocab_size == 362 and (tok.bos_id, tok.eos_id) == (1, 2)
    ids, mask = _ids_and_mask(tok, {"messages": CHAT})
    own = MistralTokenizer.from_file(str(f), mode=ValidationMode.finetuning)
    assert ids == own.encode_chat_completion(ChatCompletionRequest(messages=CHAT)).tokens
    trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    if version == "v3":     # v3 moves the system prompt into the last user turn: Axolotl's turn search
        assert trained == "Be nice.That is in.</s>"      # then misses the first reply (as here: its rule)
        _, mask3 = _ids_and_mask(tok, {"messages": CHAT[1:]})
        trained = tok.decode([i for i, m in zip(_, mask3) if m], skip_special_tokens=False)
    assert trained == "This is it.</s>That is in.</s>"
    backend = pytest.importorskip("transformers.tokenization_mistral_common")
    hf = backend.MistralCommonBackend(tokenizer_path=str(f), mode=ValidationMode.finetuning)
    assert (ids, mask) == _reference(hf, CHAT)


def test_sharegpt_keys_roles_and_the_prompt_encoding(tmp_path):
    make_tekken(tmp_path, "v7")
    tok = MistralCommonTokenizer(tmp_path / "tekken.json")
    rec = {"conversations": [{"from": "human", "value": "What is this?"}, {"from": "gpt", "value": "This is it."}]}
    ids, mask = _ids_and_mask(tok, rec, field_messages="conversations")
    assert ids == tok.encode_chat([{"role": "user", "content": "What is this?"},
                                   {"role": "assistant", "content": "This is it."}])
    prompt = tok.encode_chat([{"role": "user", "content": "What is this?"}], add_generation_prompt=True)
    assert ids[:len(prompt)] == prompt and mask[:len(prompt)] == [0] * len(prompt)
    assert tok.decode(ids[len(prompt):], skip_special_tokens=False) == "This is it.</s>"
    assert tok.token_to_id("</s>") == 2 and tok.decode(tok.encode("this is")) == "this is"
    with pytest.raises(ValueError, match="mistral-common refused the chat"):
        tok.encode_chat([{"role": "user", "content": "What is this?"}])      # (fine-tuning: ends on a reply)
    with pytest.raises(ValueError, match=r"message 2 has \['thought'\]"):
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "thought": "c"}])


def _cfg(tmp_path, **kw):
    make_tekken(tmp_path / "m", "v7")
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}\n')
    return TrainConfig.from_dict({"base_model": str(tmp_path / "m"), "tokenizer_use_mistral_common": True,
                                  "datasets": [{"path": str(data), "type": "chat_template"}], **kw})


@pytest.mark.parametrize("key,value", [("special_tokens", {"eos_token": "</s>"}), ("tokens", ["<x>"]),
                                       ("chat_template", "chatml")])
def test_options_axolotl_refuses_beside_it_are_refused(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"{key} with tokenizer_use_mistral_common"):
        _cfg(tmp_path, **{key: value})


def test_the_run_reads_it_and_a_missing_package_names_the_extra(tmp_path, monkeypatch):
    from functional_pp.app.inputs import load_tokenizer
    cfg = _cfg(tmp_path)
    assert isinstance(load_tokenizer(cfg), MistralCommonTokenizer)
    with pytest.raises(ConfigError, match=r"no mistral-common tokenizer \(tekken.json"):
        load_tokenizer(_cfg(tmp_path, tokenizer=str(tmp_path)))
    monkeypatch.setitem(sys.modules, "mistral_common.tokens.tokenizers.mistral", None)
    with pytest.raises(ConfigError, match=r"pip install 'functional_pp\[mistral\]'"):
        load_tokenizer(cfg)


def test_a_magistral_model_infers_it_as_axolotl(tmp_path):
    make_tekken(tmp_path / "Magistral-Small-2507", "v7")
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}\n')
    cfg = TrainConfig.from_dict({"base_model": str(tmp_path / "Magistral-Small-2507"),
                                 "datasets": [{"path": str(data), "type": "chat_template"}]})
    assert cfg.tokenizer_use_mistral_common and any("Magistral model" in n for n in cfg.notes)
    off = TrainConfig.from_dict({"base_model": str(tmp_path / "Magistral-Small-2507"),
                                 "tokenizer_use_mistral_common": False,
                                 "datasets": [{"path": str(data), "type": "chat_template"}]})
    assert not off.tokenizer_use_mistral_common


def test_devstrals_config_trains_and_exports_the_tekken_file(tmp_path, capsys):
    """Axolotl's Devstral QLoRA example, edited in paths and sizes only (tests/axolotl_corpus.py),
    trains 2 steps on 2 simulated devices with the mistral-common tokenizer; the merged export holds it."""
    import json

    pytest.importorskip("transformers")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from axolotl_corpus import ACCEPTED, classify

    from functional_pp import cli
    (tmp_path / "c").mkdir()
    verdict, path, devices = classify("devstral/devstral-small-qlora.yml", tmp_path / "c", tmp_path / "models")
    assert verdict == ACCEPTED, verdict
    assert cli.main(["train", str(path), "--simulate", str(devices)]) == 0
    text = capsys.readouterr().out
    assert "template mistral-common's chat encoding" in text and "vocab 362" in text
    out = tmp_path / "c" / "out"
    assert [m["step"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m] == [1, 2]
    assert cli.main(["export", "--merge-adapter", str(out), str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "tekken.json").read_bytes() == (tmp_path / "models" / "mistral" / "tekken.json").read_bytes()
