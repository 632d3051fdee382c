"""Chat data trains the right tokens: every named template (Axolotl's Jinja texts) renders and
tokenizes exactly as transformers' ``apply_chat_template``, the trained tokens are Axolotl's
(each reply's content and its end-of-turn token; transformers' assistant mask where a template
marks generations), ShareGPT data is mapped onto user / assistant, and data that would train
nothing stops the run. Tokenizers are built here (bytes + the templates' special tokens), no hub."""
import json

import pytest
from chat_tokenizer import make_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from functional_pp.config import ConfigError, DatasetConfig, TrainConfig  # noqa: E402
from functional_pp.data.chat import template_text, tokenize_chat  # noqa: E402
from functional_pp.data.formats import build_streams, chat_spec  # noqa: E402

# name -> (bos, the tokenizer's EOS: the end-of-turn token its instruct models use)
TEMPLATES = {
    "chatml": (None, "<|im_end|>"), "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama4": ("<|begin_of_text|>", "<|eot|>"), "mistral_v1": ("<s>", "</s>"),
    "mistral_v2v3": ("<s>", "</s>"), "mistral_v3_tekken": ("<s>", "</s>"),
    "mistral_v7_tekken": ("<s>", "</s>"), "gemma": ("<bos>", "<end_of_turn>"),
    "gemma3": ("<bos>", "<end_of_turn>"), "phi_3": ("<s>", "<|end|>"), "phi_35": ("<s>", "<|end|>"),
    "qwen_25": (None, "<|im_end|>"), "qwen3": (None, "<|im_end|>"), "qwen3_5": (None, "<|im_end|>"),
    "deepseek_v2": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "cohere": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"), "falcon_h1": (None, "<|im_end|>"),
}
#: templates that mark generations: trained = transformers' assistant mask
GENERATION = {"phi_4": (None, "<|im_end|>"), "llava": (None, "</s>")}

CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]


def trained_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


def _hf(tok, bos, eos):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=str(tok.file), bos_token=bos, eos_token=eos)


def _ids_and_mask(tok, name, rec, train_on_inputs=False, **entry):
    spec = chat_spec(DatasetConfig(path="x", type="chat_template", chat_template=name, **entry), tok,
                     train_inputs=train_on_inputs, default_template=None)
    return tokenize_chat(tok, rec, spec)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_named_template_renders_as_transformers_and_trains_the_replies(tmp_path, name):
    pytest.importorskip("transformers")
    bos, eos = TEMPLATES[name]
    tok = make_tokenizer(tmp_path, bos, eos)
    ids, mask = _ids_and_mask(tok, name, {"messages": CHAT})
    hf = _hf(tok, bos, eos).apply_chat_template(CHAT, chat_template=template_text(name), tokenize=True,
                                                 return_dict=True)
    assert ids == hf["input_ids"]                       # the same text, the same tokens
    # Axolotl's rule: each assistant turn's content and the end-of-turn token after it
    assert trained_text(tok, ids, mask) == f"It is 4.{eos}It is 6.{eos}"


@pytest.mark.parametrize("name", sorted(GENERATION))
def test_templates_marking_generations_train_transformers_assistant_mask(tmp_path, name):
    pytest.importorskip("transformers")
    bos, eos = GENERATION[name]
    tok = make_tokenizer(tmp_path, bos, eos)
    ids, mask = _ids_and_mask(tok, name, {"messages": CHAT})
    hf = _hf(tok, bos, eos).apply_chat_template(CHAT, chat_template=template_text(name), tokenize=True,
                                                 return_dict=True, return_assistant_tokens_mask=True)
    assert ids == hf["input_ids"] and mask == hf["assistant_masks"] and any(mask)


def test_sharegpt_from_value_and_default_roles(tmp_path):
    """ShareGPT (from / value, human / gpt) is Axolotl's default role map: the gpt turns train."""
    tok = make_tokenizer(tmp_path, "<|begin_of_text|>", "<|eot_id|>")
    rec = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                             {"from": "gpt", "value": "Hello"}]}
    for entry in ({"field_messages": "conversations"},                                  # recognised
                  {"field_messages": "conversations", "message_property_mappings": {"role": "from", "content": "value"}},
                  {"field_messages": "conversations", "message_field_role": "from", "message_field_content": "value"}):
        ids, mask = _ids_and_mask(tok, "llama3", rec, **entry)
        text = tok.decode(ids, skip_special_tokens=False)
        assert "<|start_header_id|>user<|end_header_id|>" in text and "assistant<|end_header_id|>" in text
        assert trained_text(tok, ids, mask) == "Hello<|eot_id|>"
    # roles replaces the map; roles_to_train names the data's roles or the template's
    rec2 = {"messages": [{"role": "asker", "content": "Hi"}, {"role": "bot", "content": "Yo"}]}
    ids, mask = _ids_and_mask(tok, "llama3", rec2, roles={"user": ["asker"], "assistant": ["bot"]})
    assert trained_text(tok, ids, mask) == "Yo<|eot_id|>"
    ids, mask = _ids_and_mask(tok, "llama3", rec2, roles={"user": ["asker"], "assistant": ["bot"]},
                              roles_to_train=["asker", "bot"])
    assert trained_text(tok, ids, mask) == "Hi<|eot_id|>Yo<|eot_id|>"


def test_train_on_eos_train_on_inputs_and_drop_system_message(tmp_path):
    tok = make_tokenizer(tmp_path, None, "<|im_end|>")
    rec = {"messages": [{"role": "system", "content": "S"}, *CHAT]}
    t = lambda **kw: trained_text(tok, *_ids_and_mask(tok, "chatml", rec, **kw))  # noqa: E731
    assert t() == "It is 4.<|im_end|>It is 6.<|im_end|>"
    assert t(train_on_eos="none") == "It is 4.It is 6."
    assert t(train_on_eos="last") == "It is 4.It is 6.<|im_end|>"
    # all: the end-of-turn token of every turn, trained or not (not the untrained contents)
    assert t(train_on_eos="all") == "<|im_end|><|im_end|>It is 4.<|im_end|><|im_end|>It is 6.<|im_end|>"
    # train_on_inputs: every turn's content (Axolotl: the role headers stay untrained)
    assert t(train_on_inputs=True) == ("S<|im_end|>What is 2+2?<|im_end|>It is 4.<|im_end|>"
                                       "And 3+3?<|im_end|>It is 6.<|im_end|>")
    ids, _ = _ids_and_mask(tok, "chatml", rec, drop_system_message=True)
    assert "system" not in tok.decode(ids, skip_special_tokens=False)
    # a per-message training flag
    rec3 = {"messages": [CHAT[0], {**CHAT[1], "train": False}, CHAT[2], CHAT[3]]}
    assert trained_text(tok, *_ids_and_mask(tok, "chatml", rec3, message_field_training="train")) \
        == "It is 6.<|im_end|>"


def test_template_choices(tmp_path):
    own = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    tok = make_tokenizer(tmp_path / "own", None, "</s>", template=own)
    bare = make_tokenizer(tmp_path / "bare", "<s>", "</s>")
    rec = {"messages": CHAT[:2]}
    text = lambda t, **kw: t.decode(_ids_and_mask(t, **kw, rec=rec)[0], skip_special_tokens=False)  # noqa: E731
    assert text(tok, name="tokenizer_default") == "<<user>>What is 2+2?</s><<assistant>>It is 4.</s>"
    assert text(tok, name=None) == "<<user>>What is 2+2?</s><<assistant>>It is 4.</s>"      # unset: the tokenizer's
    assert text(bare, name=None).startswith("<|im_start|>user")                              # ... else ChatML
    assert text(tok, name="tokenizer_default_fallback_llama3") == text(tok, name="tokenizer_default")
    assert text(bare, name="tokenizer_default_fallback_llama3").startswith("<s><|start_header_id|>user")
    assert text(bare, name="jinja", chat_template_jinja=own) == "<<user>>What is 2+2?</s><<assistant>>It is 4.</s>"
    f = tmp_path / "t.jinja"
    f.write_text(own)
    assert text(bare, name="jinja", chat_template_jinja=str(f)).startswith("<<user>>")
    with pytest.raises(ValueError, match="tokenizer has no chat_template"):
        text(bare, name="tokenizer_default")
    trained = trained_text(tok, *_ids_and_mask(tok, "tokenizer_default", rec))
    assert trained == "It is 4.</s>"


def test_unknown_or_literal_template_names_are_refused():
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"chat_template": "llama_3"})
    msg = str(e.value)
    assert "chat_template: unknown chat template 'llama_3'; did you mean 'llama3'?" in msg
    for name in ("chatml", "llama3", "gemma3", "qwen3", "mistral_v7_tekken", "tokenizer_default"):
        assert name in msg
    with pytest.raises(ConfigError, match=r"datasets\[0\].chat_template: unknown chat template 'nope'"):
        TrainConfig.from_dict({"datasets": [{"path": "x.jsonl", "type": "chat_template", "chat_template": "nope"}]})
    with pytest.raises(ConfigError, match="chat_template: jinja with chat_template_jinja"):
        TrainConfig.from_dict({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    with pytest.raises(ConfigError, match="jinja needs chat_template_jinja"):
        TrainConfig.from_dict({"chat_template": "jinja"})
    for name in ("llama3", "llama4", "qwen_25", "tokenizer_default", "tokenizer_default_fallback_chatml"):
        assert TrainConfig.from_dict({"chat_template": name}).chat_template == name
    assert TrainConfig.from_dict({"chat_template": "jinja", "chat_template_jinja": "{{ 1 }}"}).chat_template == "jinja"


def test_rows_with_no_trained_token_are_counted_and_mostly_none_stops(tmp_path):
    tok = make_tokenizer(tmp_path, "<|begin_of_text|>", "<|eot_id|>")
    good = {"messages": CHAT[:2]}
    no_reply = {"messages": [CHAT[0]]}
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good, good, good, no_reply]) + "\n")
    entry = DatasetConfig(path=str(path), type="chat_template", chat_template="llama3")
    train, _ = build_streams([entry], tok, seq_len=32)
    st = train.stats[0]
    assert (st.rows, st.untrained_rows) == (4, 1) and st.trained_tokens == 3 * len(tok.encode("It is 4.")) + 3
    assert "[[It is 4.<|eot_id|>]]" in st.trained_sample and "4 rows" in st.line()
    # roles the map does not know: nothing would be trained -> stop, naming what was used
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "asker", "content": "Hi"}, {"role": "bot", "content": "Yo"}]}) + "\n")
    with pytest.raises(ValueError) as e:
        build_streams([entry, DatasetConfig(path=str(bad), type="chat_template", chat_template="llama3")],
                      tok, seq_len=32)
    msg = str(e.value)
    assert msg.startswith("datasets[1] (") and "1 of 1 rows have no trained token" in msg
    assert '"role": "bot"' in msg and "trained roles ['assistant']" in msg and "template llama3" in msg


def test_an_eos_the_template_never_writes_is_noted(tmp_path):
    """A base model's EOS (<|end_of_text|>) with the llama3 template: as in Axolotl no end-of-turn
    token is trained, and the counts line says so, pointing at eot_tokens."""
    tok = make_tokenizer(tmp_path, "<|begin_of_text|>", "<|end_of_text|>")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": CHAT[:2]}) + "\n")
    entry = DatasetConfig(path=str(path), type="chat_template", chat_template="llama3")
    st = build_streams([entry], tok, seq_len=32)[0].stats[0]
    assert "not in the chat template" in st.line() and "eot_tokens" in st.line()
    st = build_streams([entry], tok, seq_len=32, eot_tokens=["<|eot_id|>"])[0].stats[0]
    assert "note" not in st.line() and "[[It is 4.<|eot_id|>]]" in st.trained_sample


def test_the_tokenizers_template_file_and_named_templates(tmp_path):
    """tokenizer_default finds the template where transformers does: tokenizer_config.json's
    chat_template (a text, or named ones: "default"), else chat_template.jinja beside it."""
    own = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    tok = make_tokenizer(tmp_path / "a", None, "</s>")
    (tmp_path / "a" / "chat_template.jinja").write_text(own)
    from functional_pp.data.tokenizer import HFTokenizer
    assert HFTokenizer(tmp_path / "a").chat_template == own
    tok = make_tokenizer(tmp_path / "b", None, "</s>", template=[{"name": "tool_use", "template": "x"},
                                                                {"name": "default", "template": own}])
    assert tok.chat_template == own


def _axolotl_reference(hf, template, turns):
    """Axolotl's ChatTemplateStrategy (roles_to_train [assistant], train_on_eos turn), written
    on transformers' apply_chat_template as Axolotl calls it: the reference for our masks."""
    def ids(ts, **kw):
        out = hf.apply_chat_template(ts, chat_template=template, tokenize=True, return_dict=True, **kw)
        return list(out["input_ids"])
    full = ids(turns)
    labels = [0] * len(full)
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        kw = {"real_last_index": len(turns) - 1}
        dummy, real = ids(turns[:i] + [{"role": turn["role"], "content": "[[dummy_message]]"}], **kw), ids(turns[:i + 1], **kw)
        n = min(len(dummy), len(real))
        start = next(j for j in range(n) if dummy[j] != real[j])
        end = next(len(real) - j for j in range(n) if dummy[-1 - j] != real[-1 - j])
        labels[start:end] = [1] * (end - start)
        eos = next((j for j in range(end, len(full)) if full[j] == hf.eos_token_id), -1)
        if eos != -1 and abs(eos - end) <= 3:
            labels[eos] = 1
    return full, labels


@pytest.mark.parametrize("name", ["chatml", "llama3", "qwen3", "mistral_v1", "mistral_v2v3", "gemma3", "phi_3",
                                  "qwen_25", "deepseek_v2", "cohere", "llama4"])
def test_masks_equal_axolotls_rule_with_a_trained_bpe(tmp_path, name):
    """With merges that join a header's last characters to a reply's first ones, the trained
    tokens still equal Axolotl's rule computed on transformers' tokenizer."""
    pytest.importorskip("transformers")
    from chat_tokenizer import make_bpe_tokenizer
    bos, eos = TEMPLATES[name]
    turns = [{"role": "user", "content": " Hello there, what is two plus two?"},
             {"role": "assistant", "content": "Two plus two is four.\n"},
             {"role": "user", "content": "And three plus three? "},
             {"role": "assistant", "content": " Three plus three is six."}]
    corpus = [template_text(name)] + [t["content"] for t in turns] * 20 + ["\n\nTwo\nThree assistant user"] * 20
    tok = make_bpe_tokenizer(tmp_path, bos, eos, corpus)
    ids, mask = _ids_and_mask(tok, name, {"messages": turns})
    ref_ids, ref_mask = _axolotl_reference(_hf(tok, bos, eos), template_text(name), turns)
    assert ids == ref_ids and mask == ref_mask and sum(mask) > 10


def test_special_tokens_eos_is_the_end_of_turn_and_document_end(tmp_path):
    """Axolotl's special_tokens: {eos_token: <|eot_id|>} on a base tokenizer makes <|eot_id|> the
    EOS: trained after each reply and ending each document; a token not in the vocabulary is
    refused (adding tokens is not supported)."""
    from functional_pp.app.inputs import load_data
    make_tokenizer(tmp_path / "tok", "<|begin_of_text|>", "<|end_of_text|>")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": CHAT[:2]}) + "\n")
    base = {"tokenizer": str(tmp_path / "tok"), "chat_template": "llama3",
            "datasets": [{"path": str(path), "type": "chat_template"}]}
    cfg = TrainConfig.from_dict({**base, "special_tokens": {"eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"}})
    data = load_data(cfg)
    tok = data.tokenizer
    assert tok.eos_id == tok.tok.token_to_id("<|eot_id|>") == data.train.eos_id
    assert "[[It is 4.<|eot_id|>]]" in data.train.stats[0].trained_sample
    ids = data.train.tokens.tolist()
    assert ids.count(tok.eos_id) == 2 and ids[-1] == tok.eos_id        # the chat's own EOT ends it
    with pytest.raises(ConfigError, match="special_tokens.eos_token: '<\\|nope\\|>' is not a token"):
        load_data(TrainConfig.from_dict({**base, "special_tokens": {"eos_token": "<|nope|>"}}))
    with pytest.raises(ConfigError, match="special_tokens must map some of bos_token, eos_token"):
        TrainConfig.from_dict({**base, "special_tokens": {"eot": "x"}})
