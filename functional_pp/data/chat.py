"""Chat data as Axolotl's ``type: chat_template`` reads it: a conversation's messages mapped onto
``role`` / ``content``, rendered with a named chat template (the Jinja texts Axolotl ships, in
``chat_templates/``; Apache-2.0, see its README) or the tokenizer's own, and tokenized with a
flag per token saying whether it is trained.

Which tokens are trained (``docs/data.md``, "Chat data"):

- a template that marks generations (``{% generation %}`` ... ``{% endgeneration %}``): the tokens
  overlapping those blocks, exactly ``transformers``' ``apply_chat_template(...,
  return_assistant_tokens_mask=True)``, when the dataset asks for the default (the assistant's
  turns, no ``train_on_inputs``, no per-message ``training`` field);
- otherwise Axolotl's rule (``ChatTemplateStrategy``): a trained turn's tokens are those that
  differ between the conversation rendered up to that turn and the same with the turn's content
  replaced by a placeholder (its content, not the role header); the end-of-turn token (the
  tokenizer's EOS, or ``eot_tokens``) within 3 tokens after a turn follows ``train_on_eos`` /
  ``train_on_eot``: ``turn`` (the default: after trained turns), ``all``, ``last``, ``none``.

Rendering is transformers' (``apply_chat_template``): Jinja2 in a sandbox with ``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII text, and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as
variables; the text is tokenized without adding special tokens (the template writes them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from functional_pp.core.optional import require
from functional_pp.data.utf8 import read_text

__all__ = ["TEMPLATE_DIR", "template_names", "template_text", "resolve_template", "check_template_choice",
           "ChatSpec", "DEFAULT_ROLES", "tokenize_chat", "has_generation_marks", "render"]

TEMPLATE_DIR = Path(__file__).with_name("chat_templates")
JINJA = "jinja"
DEFAULT = "tokenizer_default"
FALLBACK_PREFIX = "tokenizer_default_fallback_"
#: Axolotl's default role map (``roles`` replaces it): a dataset's role -> the template's
DEFAULT_ROLES = {"human": "user", "user": "user", "assistant": "assistant", "gpt": "assistant",
                 "system": "system", "tool": "tool"}
TRAIN_ON_EOS = ("all", "turn", "last", "none")
_DUMMY = "[[dummy_message]]"


@lru_cache(maxsize=None)
def template_names() -> tuple[str, ...]:
    """The named templates (``chatml``, ``llama3``, ...): the files of ``chat_templates/``."""
    return tuple(sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja")))


@lru_cache(maxsize=None)
def template_text(name: str) -> str:
    return (TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def _known() -> str:
    return (f"{', '.join(template_names())}, {DEFAULT}, {FALLBACK_PREFIX}<name>, "
            f"{JINJA} (with chat_template_jinja)")


def check_template_choice(choice: Any, jinja: Any, key: str = "chat_template") -> str | None:
    """The problem with a ``chat_template`` choice (None: it is fine). A name is never Jinja."""
    if choice is None:
        return None
    if not isinstance(choice, str):
        return f"{key} must be a template name, got {choice!r} (known: {_known()})"
    if choice == JINJA:
        if not jinja:
            return (f"{key}: jinja needs chat_template_jinja: the template text or a .jinja file")
        return None
    if jinja is not None:
        return (f"chat_template_jinja is only read with {key}: jinja (it is {choice!r}); set "
                f"{key}: jinja or remove chat_template_jinja")
    if choice == DEFAULT:
        return None
    name = choice[len(FALLBACK_PREFIX):] if choice.startswith(FALLBACK_PREFIX) else choice
    if name in template_names():
        return None
    if "{%" in choice or "{{" in choice:
        return (f"{key}: a Jinja template is given as chat_template: jinja with "
                f"chat_template_jinja: <the text>, not as a name (known names: {_known()})")
    import difflib
    close = difflib.get_close_matches(name, template_names(), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{key}: unknown chat template {choice!r}{hint} (known: {_known()})"


def resolve_template(choice: str | None, jinja: str | None, tokenizer_template: str | None,
                     where: str = "chat_template") -> tuple[str, str]:
    """``(template text, what it is)`` for a choice, as Axolotl's ``get_chat_template``:
    ``tokenizer_default`` (the default) is the tokenizer's template, ``tokenizer_default_fallback_X``
    the tokenizer's or else X, ``jinja`` the ``chat_template_jinja`` text (or file), any other
    name the named template."""
    choice = choice or DEFAULT
    problem = check_template_choice(choice, jinja, where)
    if problem:
        raise ValueError(problem)
    if choice == JINJA:
        p = Path(str(jinja))
        if len(str(jinja)) < 4096 and "\n" not in str(jinja) and _is_file(p):
            return read_text(p), f"jinja ({p})"
        return str(jinja), "jinja (chat_template_jinja)"
    if choice == DEFAULT:
        if not tokenizer_template:
            raise ValueError(f"{where}: tokenizer_default, but the tokenizer has no chat_template "
                             f"(tokenizer_config.json); name one, e.g. {where}: chatml, or use "
                             f"tokenizer_default_fallback_chatml")
        return tokenizer_template, "the tokenizer's chat_template"
    if choice.startswith(FALLBACK_PREFIX):
        if tokenizer_template:
            return tokenizer_template, "the tokenizer's chat_template"
        choice = choice[len(FALLBACK_PREFIX):]
    return template_text(choice), choice


def _is_file(p: Path) -> bool:
    """Whether ``p`` names a file (a one-line template longer than a file name is not one)."""
    try:
        return p.is_file()
    except OSError:
        return False


def has_generation_marks(template: str) -> bool:
    import re
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


# --------------------------------------------------------------------------- rendering
@lru_cache(maxsize=64)
def _compiled(template: str):
    jinja2 = require("jinja2", "hf", "a chat template")
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: records the character span rendered."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            return f"\x00GEN<\x00{text}\x00GEN>\x00"

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        from datetime import datetime
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def render(template: str, messages: list[dict], special_tokens: dict | None = None,
           add_generation_prompt: bool = False, **kwargs) -> tuple[str, list[tuple[int, int]]]:
    """``(text, generation spans)``: ``messages`` rendered as transformers'
    ``apply_chat_template(tokenize=False)`` does; the spans are the character ranges of
    ``{% generation %}`` blocks."""
    jinja2 = require("jinja2", "hf", "a chat template")
    try:
        raw = _compiled(template).render(messages=messages, tools=kwargs.pop("tools", None),
                                         documents=None, add_generation_prompt=add_generation_prompt,
                                         **(special_tokens or {}), **kwargs)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"the chat template failed: {exc}") from exc
    if "\x00GEN" not in raw:
        return raw, []
    import re
    text, spans, n, start = [], [], 0, 0
    for piece in re.split("(\x00GEN[<>]\x00)", raw):
        if piece == "\x00GEN<\x00":
            start = n
        elif piece == "\x00GEN>\x00":
            spans.append((start, n))
        else:
            text.append(piece)
            n += len(piece)
    return "".join(text), spans


# --------------------------------------------------------------------------- a conversation
@dataclass
class ChatSpec:
    """How one dataset's conversations are read (Axolotl's ``datasets[]`` chat keys)."""

    template: str
    template_name: str = ""
    field_messages: str = "messages"
    mappings: dict = field(default_factory=lambda: {"role": "role", "content": "content"})
    mappings_given: bool = False
    roles: dict = field(default_factory=lambda: dict(DEFAULT_ROLES))
    roles_to_train: tuple = ("assistant",)
    train_on_inputs: bool = False
    train_on_eos: str | None = "turn"
    train_on_eot: str | None = None
    eot_ids: tuple = ()
    eos_id: int | None = None
    drop_system_message: bool = False
    field_system: str = "system"
    message_field_training: str | None = None
    #: (the key the template reads the reasoning from, the message's key holding it): Axolotl's
    #: template_thinking_key and field_thinking
    thinking: tuple = ("reasoning_content", "reasoning_content")
    special_tokens: dict = field(default_factory=dict)
    template_kwargs: dict = field(default_factory=dict)
    warning: str = ""                 # shown with the dataset's counts (start-up summary)

    @property
    def uses_generation_marks(self) -> bool:
        return (has_generation_marks(self.template) and not self.train_on_inputs
                and set(self.roles_to_train) == {"assistant"} and not self.message_field_training)

    def describe_roles(self) -> str:
        used = {k: v for k, v in self.roles.items() if k != v}
        return (f"message keys {self.mappings}, roles {used or 'as given'}, trained roles "
                f"{list(self.roles_to_train)}")


def conversation(rec: Any, spec: ChatSpec) -> list[dict]:
    """The turns of a record: messages mapped onto the template's keys (Axolotl's
    ``get_conversation_thread``)."""
    if not isinstance(rec, dict) or spec.field_messages not in rec:
        have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise ValueError(f"the record has no field {spec.field_messages!r} (it has {have}); set "
                         f"field_messages")
    messages = rec[spec.field_messages]
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            pass
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"{spec.field_messages!r} must be a list of messages (mappings), got "
                         f"{type(messages).__name__}")
    turns = []
    for i, m in enumerate(messages):
        mapping = spec.mappings
        if not spec.mappings_given and "role" not in m and "from" in m:   # ShareGPT
            mapping = {**mapping, "role": "from", "content": "value"}
        if spec.thinking[0] not in mapping:           # the reasoning trace, under the template's key
            mapping = {**mapping, spec.thinking[0]: spec.thinking[1]}
        t = {k: m[v] for k, v in mapping.items() if m.get(v) is not None}
        mapped = set(mapping.values())
        for k, v in m.items():        # other keys the template may read (tool_calls, name, ...)
            if k not in mapped and k not in t and v is not None and k in ("tool_calls", "name",
                                                                          "tool_call_id", "reasoning_content"):
                t[k] = v
        if spec.thinking[0] in t and not isinstance(t[spec.thinking[0]], str):
            raise ValueError(f"message {i + 1}: the reasoning {spec.thinking[1]!r} is "
                             f"{type(t[spec.thinking[0]]).__name__}, not text; give text")
        if not isinstance(t.get("content", ""), (str, list)):
            raise ValueError(f"message {i + 1}: content is {type(t['content']).__name__} "
                             f"({json.dumps(t['content'], default=str)[:80]}), not text; give text")
        if "role" in t:
            t["role"] = spec.roles.get(t["role"], t["role"])
        if isinstance(t.get("content"), list):      # content parts: their text, joined
            t["content"] = "".join(p.get("text") or p.get("content") or p.get("value") or ""
                                   for p in t["content"] if isinstance(p, dict))
        if spec.message_field_training and m.get(spec.message_field_training) is not None:
            t["training"] = bool(m[spec.message_field_training])
        turns.append(t)
    if turns and turns[0].get("role") != "system" and isinstance(rec.get(spec.field_system), str):
        turns.insert(0, {"role": "system", "content": rec[spec.field_system]})
    if spec.drop_system_message and turns and turns[0].get("role") == "system":
        turns = turns[1:]
    if not turns:
        raise ValueError(f"{spec.field_messages!r} holds no messages")
    for t in turns:
        if "role" not in t:
            raise ValueError(f"a message has no role under the mapping {spec.mappings} (message "
                             f"keys: {sorted(messages[0])}); set message_property_mappings")
    return turns


def _strip(turns: list[dict]) -> list[dict]:
    return [{k: v for k, v in t.items() if k != "training"} for t in turns]


def tokenize_chat(tok, rec: Any, spec: ChatSpec) -> tuple[list[int], list[int]]:
    """``(token ids, trained flags)`` of one record (see the module docstring for the rule)."""
    turns = conversation(rec, spec)

    encode_chat = getattr(tok, "encode_chat", None)      # a mistral-common tokenizer encodes chats itself

    def ids_of(ts: list[dict], gen: bool = False, **kw) -> list[int]:
        if encode_chat is not None:
            return encode_chat(_strip(ts), gen)
        return tok.encode(render(spec.template, _strip(ts), spec.special_tokens, gen,
                                 **spec.template_kwargs, **kw)[0])

    if spec.uses_generation_marks:
        text, spans = render(spec.template, _strip(turns), spec.special_tokens, False,
                             **spec.template_kwargs)
        ids, offsets = tok.encode_offsets(text)
        mask = [0] * len(ids)
        k = 0
        for j, (s, e) in enumerate(offsets):          # transformers' assistant_masks
            while k < len(spans) and s >= spans[k][1]:
                k += 1
            if k == len(spans):
                break
            if e > spans[k][0]:
                mask[j] = 1
        return ids, mask

    train_eot = spec.train_on_eot if spec.train_on_eot is not None else spec.train_on_eos
    if not spec.roles_to_train and not spec.train_on_eos and not train_eot and not spec.message_field_training:
        prompt = ids_of(turns[:-1], gen=True)        # Axolotl's legacy rule: the last reply
        full = ids_of(turns)
        ids = prompt + full[len(prompt):]
        return ids, ([1] * len(ids) if spec.train_on_inputs else [0] * len(prompt) + [1] * (len(ids) - len(prompt)))

    ids = ids_of(turns)
    mask = [0] * len(ids)
    eot = set(spec.eot_ids)
    last = {"EOT": -1, "EOS": -1}
    for i, turn in enumerate(turns):
        if "training" in turn:
            should = turn["training"]
        else:
            should = spec.train_on_inputs or turn.get("role") in spec.roles_to_train
        if not should and spec.train_on_eos != "all" and train_eot != "all":
            continue
        start, end = _find_turn(turns, i, ids_of)
        if should and start != -1 and end != -1:
            for j in range(start, min(end, len(ids))):
                mask[j] = 1
        for kind, wanted, option in (("EOT", eot, train_eot), ("EOS", {spec.eos_id}, spec.train_on_eos)):
            j = _first(ids, wanted, end)
            if j != -1 and abs(j - end) <= 3:
                last[kind] = j
                if option == "all" or (option == "turn" and should):
                    mask[j] = 1
    for kind, option in (("EOT", train_eot), ("EOS", spec.train_on_eos)):
        if option == "last" and last[kind] != -1:
            mask[last[kind]] = 1
    return ids, mask


def _first(ids: list[int], wanted: set, start: int) -> int:
    """The first index from ``start`` holding one of ``wanted`` (-1: none), as Axolotl's
    ``find_first_eos_token`` (``range(start, len)``, so a start of -1 looks at the last token
    first)."""
    for j in range(start, len(ids)):
        if ids[j] in wanted:
            return j
    return -1


def _find_turn(turns: list[dict], i: int, ids_of) -> tuple[int, int]:
    """Token range of turn ``i``'s content: where the conversation up to it differs from the same
    with the content replaced by a placeholder (Axolotl's ``find_turn``)."""
    dummy = {"role": turns[i].get("role"), "content": _DUMMY}
    # templates that render the last turn differently (qwen3's thinking block) read
    # real_last_index, as Axolotl passes it
    kw = {"real_last_index": len(turns) - 1} if len(turns) > 1 else {}
    try:
        dummy_ids = ids_of(turns[:i] + [dummy], **kw)
    except ValueError:
        return -1, -1
    full_ids = ids_of(turns[:i + 1], **kw)
    if not full_ids or not dummy_ids:
        return -1, -1
    n = min(len(dummy_ids), len(full_ids))
    start = next((j for j in range(n) if dummy_ids[j] != full_ids[j]), None)
    end = next((len(full_ids) - j for j in range(n)
                if dummy_ids[len(dummy_ids) - 1 - j] != full_ids[len(full_ids) - 1 - j]), None)
    if start is None or end is None or end <= start:
        return -1, -1
    return start, end


def sample_text(tok, ids: Sequence[int], mask: Sequence[int], limit: int = 2000) -> str:
    """A decoded example with the trained tokens marked ``[[...]]`` (as Axolotl's debug view)."""
    out, run, flag = [], [], None
    for t, m in zip(ids, mask):
        if m != flag and run:
            text = tok.decode(run, skip_special_tokens=False)
            out.append(f"[[{text}]]" if flag else text)
            run = []
        flag = m
        run.append(t)
    if run:
        text = tok.decode(run, skip_special_tokens=False)
        out.append(f"[[{text}]]" if flag else text)
    s = "".join(out)
    return s if len(s) <= limit else s[:limit] + " ..."
