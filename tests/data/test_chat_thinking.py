"""Reasoning traces in chat data (Axolotl's ``field_thinking`` / ``template_thinking_key``,
issue 47): a message's reasoning (``reasoning_content`` by default, or the dataset's
``field_thinking``) is handed to the chat template under the key it reads
(``template_thinking_key``: Qwen3's ``reasoning_content``, gpt-oss's ``thinking``); the tokens
equal transformers' ``apply_chat_template`` of the messages so keyed, and the trained tokens equal
Axolotl's rule on them (the reasoning inside the reply's trained span); a trace that is not text
is refused naming the message."""
import pytest
from chat_tokenizer import make_tokenizer
from test_chat_templates import _axolotl_reference, _hf, _ids_and_mask, trained_text

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from functional_pp.data.chat import template_text  # noqa: E402

#: a gpt-oss-like template: the assistant's reasoning under ``thinking``, in its own channel
THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and message.thinking is defined -%}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "{%- endif -%}"
    "<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{%- endfor -%}")


def _chat(key):
    return [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "It is 4.", key: "Two and two make four."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "It is 6.", key: "Three and three make six."}]


def _keyed(messages, data_key, template_key):
    return [{(template_key if k == data_key else k): v for k, v in m.items()} for m in messages]


@pytest.mark.parametrize("data_key", ["reasoning_content", "thought"])
def test_qwen3_reads_the_reasoning_and_trains_it_with_the_reply(tmp_path, data_key):
    pytest.importorskip("transformers")
    tok = make_tokenizer(tmp_path, None, "<|im_end|>")
    entry = {} if data_key == "reasoning_content" else {"field_thinking": data_key}
    ids, mask = _ids_and_mask(tok, "qwen3", {"messages": _chat(data_key)}, **entry)
    turns = _keyed(_chat(data_key), data_key, "reasoning_content")
    ref_ids, ref_mask = _axolotl_reference(_hf(tok, None, "<|im_end|>"), template_text("qwen3"), turns)
    assert ids == ref_ids and mask == ref_mask
    text = trained_text(tok, ids, mask)
    assert "Three and three make six." in text and text.endswith("It is 6.<|im_end|>")


def test_gpt_oss_style_thinking_key(tmp_path):
    pytest.importorskip("transformers")
    tok = make_tokenizer(tmp_path, None, "<|end|>")
    rec = {"conversation": _chat("thinking")}
    ids, mask = _ids_and_mask(tok, "jinja", rec, chat_template_jinja=THINKING_TEMPLATE, field_messages="conversation",
                              field_thinking="thinking", template_thinking_key="thinking")
    ref_ids, ref_mask = _axolotl_reference(_hf(tok, None, "<|end|>"), THINKING_TEMPLATE, _chat("thinking"))
    assert ids == ref_ids and mask == ref_mask
    assert "Two and two make four." in tok.decode(ids) and "Two and two make four." in trained_text(tok, ids, mask)
    # without the keys the template reads no reasoning (the data's "thinking" is not its reasoning_content)
    plain, _ = _ids_and_mask(tok, "jinja", rec, chat_template_jinja=THINKING_TEMPLATE, field_messages="conversation",
                             field_thinking="reasoning_content")
    assert "Two and two make four." not in tok.decode(plain)


def test_a_reasoning_that_is_not_text_is_refused_naming_the_message(tmp_path):
    tok = make_tokenizer(tmp_path, None, "<|im_end|>")
    bad = _chat("reasoning_content")
    bad[3]["reasoning_content"] = {"steps": [1, 2]}
    with pytest.raises(ValueError, match="message 4: the reasoning 'reasoning_content' is dict, not text"):
        _ids_and_mask(tok, "qwen3", {"messages": bad})
