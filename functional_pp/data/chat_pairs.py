"""Axolotl's ``chat_template.*`` preference dataset types (its
``prompt_strategies/dpo/chat_template.py``): a record's conversation rendered with the run's
chat template into TRL's prompt / chosen / rejected texts (docs/preference.md).

- ``chat_template.default``: the prompt is ``field_messages`` (a list of messages, or one text:
  a user turn) rendered with the generation prompt; ``field_chosen`` / ``field_rejected`` is a
  reply: a text (the assistant's), a message, or a list of messages (the last one is the reply).
- ``chat_template.argilla_chat``: ``field_chosen`` / ``field_rejected`` are whole conversations;
  the prompt is the chosen one without its last message, each reply its last message.

A reply's text is the template's rendering of ``[user placeholder, reply]`` from where the
reply's content first occurs, trailing whitespace removed (the template's end-of-turn marker
kept), as Axolotl writes it. Messages are read through ``message_property_mappings`` (``role``,
``content``) and their roles through ``roles`` (template role -> the data's roles; default
``user``, ``assistant``, ``system``, ``tool`` as they are). A role the map lacks, a message
without its role or content, or a reply the template does not write as given is refused
naming the record and what to set."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from functional_pp.data.chat import render

__all__ = ["CHAT_PAIR_TYPES", "ChatPairReader"]

CHAT_PAIR_TYPES = ("chat_template.default", "chat_template.argilla_chat")
#: Axolotl's default ``roles`` for preference data (no human / gpt aliases)
_ROLES = {"user": ["user"], "assistant": ["assistant"], "system": ["system"], "tool": ["tool"]}
_PLACEHOLDER = {"role": "user", "content": "[[dummy_message]]"}


@dataclass
class ChatPairReader:
    """Reads one ``chat_template.*`` dataset entry's records into ``(prompt, chosen, rejected)``
    texts with ``template`` (its text) and the tokenizer's ``special_tokens``."""

    kind: str
    template: str
    special_tokens: dict
    field_messages: str = "messages"
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"
    role_key: str = "role"
    content_key: str = "content"
    role_map: dict | None = None

    @classmethod
    def for_entry(cls, entry: Any, template: str, special_tokens: dict) -> "ChatPairReader":
        """The reader of a ``datasets:`` entry (DatasetConfig); ``roles`` must map each of the
        template's roles to a list of the data's role names."""
        mappings = dict(getattr(entry, "message_property_mappings", None) or {})
        for key in ("role", "content"):
            legacy = getattr(entry, f"message_field_{key}", None)
            if legacy is not None:
                mappings.setdefault(key, legacy)
        roles = getattr(entry, "roles", None) or _ROLES
        if not isinstance(roles, dict) or not all(isinstance(v, (list, str)) for v in roles.values()):
            raise ValueError(f"roles must map each template role to a list of the data's roles, e.g. "
                             f"{{user: [human], assistant: [gpt]}}, got {roles!r}")
        role_map = {src: target for target, sources in roles.items()
                    for src in ([sources] if isinstance(sources, str) else sources)}
        return cls(entry.type, template, dict(special_tokens),
                   field_messages=getattr(entry, "field_messages", None) or "messages",
                   field_chosen=getattr(entry, "field_chosen", None) or "chosen",
                   field_rejected=getattr(entry, "field_rejected", None) or "rejected",
                   role_key=mappings.get("role", "role"), content_key=mappings.get("content", "content"),
                   role_map=role_map)

    # ------------------------------------------------------------------ messages
    def _message(self, m: Any, what: str) -> dict:
        """A data message as ``{role, content}`` in the template's roles."""
        if not isinstance(m, dict):
            raise ValueError(f"{what} is a {type(m).__name__}, not a message (a mapping with "
                             f"{self.role_key!r} and {self.content_key!r})")
        for key, which in ((self.role_key, "role"), (self.content_key, "content")):
            if key not in m:
                raise ValueError(f"{what} has no {key!r} (its keys: {sorted(m)}); set "
                                 f"message_property_mappings.{which} to the key holding its {which}")
        role, content = m[self.role_key], m[self.content_key]
        if role not in self.role_map:
            raise ValueError(f"{what} has role {role!r}, which roles does not map (it maps "
                             f"{', '.join(map(repr, self.role_map))}); add it to roles, e.g. roles: "
                             f"{{user: [{role}]}}")
        if not isinstance(content, str):
            raise ValueError(f"{what}: content is {json.dumps(content, default=str)[:80]}, not text")
        return {"role": self.role_map[role], "content": content}

    def _field(self, rec: dict, key: str) -> Any:
        if key not in rec:
            which = {self.field_messages: "field_messages", self.field_chosen: "field_chosen",
                     self.field_rejected: "field_rejected"}.get(key, "the field")
            raise ValueError(f"no field {key!r} (the record has {sorted(rec)}); set {which}")
        return rec[key]

    def _reply(self, raw: Any, key: str) -> dict:
        """A reply field: a text (the assistant's), a message, or messages (the last one)."""
        if isinstance(raw, str):
            return self._message({self.role_key: "assistant", self.content_key: raw}, f"field {key!r}")
        if isinstance(raw, list):
            if not raw:
                raise ValueError(f"field {key!r} is an empty list of messages; give the reply")
            return self._message(raw[-1], f"field {key!r}: its last message")
        return self._message(raw, f"field {key!r}")

    def _conversation(self, raw: Any, key: str) -> list[dict]:
        if isinstance(raw, str):            # one text: a user turn
            return [self._message({self.role_key: "user", self.content_key: raw}, f"field {key!r}")]
        if not isinstance(raw, list):
            raise ValueError(f"field {key!r} must be a list of messages, got {type(raw).__name__}")
        return [self._message(m, f"field {key!r}: message {i + 1}") for i, m in enumerate(raw)]

    # ------------------------------------------------------------------ texts
    def _reply_text(self, reply: dict, key: str) -> str:
        text = render(self.template, [_PLACEHOLDER, reply], self.special_tokens, False)[0]
        at = text.find(reply["content"])
        if at < 0 or not reply["content"]:
            raise ValueError(f"field {key!r}: the chat template does not write the reply "
                             f"{reply['content'][:60]!r} as given (it trims or changes it), so its tokens "
                             f"cannot be found; strip the reply's surrounding whitespace, or leave it out"
                             if reply["content"] else f"field {key!r}: the reply is empty; every pair needs "
                             f"two completions")
        return text[at:].rstrip()

    def texts(self, rec: Any) -> tuple[str, str, str]:
        """``(prompt, chosen, rejected)`` texts of a record."""
        if not isinstance(rec, dict):
            raise ValueError(f"a {type(rec).__name__}, not a mapping of fields")
        if self.kind == "chat_template.argilla_chat":
            chosen_conv = self._field(rec, self.field_chosen)
            rejected_conv = self._field(rec, self.field_rejected)
            for raw, key in ((chosen_conv, self.field_chosen), (rejected_conv, self.field_rejected)):
                if not isinstance(raw, list) or len(raw) < 2:
                    raise ValueError(f"field {key!r} must be a conversation: a list of messages ending with "
                                     f"the reply, got {json.dumps(raw, default=str)[:80]}")
            prompt = self._conversation(chosen_conv[:-1], self.field_chosen)
            chosen = self._message(chosen_conv[-1], f"field {self.field_chosen!r}: its last message")
            rejected = self._message(rejected_conv[-1], f"field {self.field_rejected!r}: its last message")
        else:
            prompt = self._conversation(self._field(rec, self.field_messages), self.field_messages)
            chosen = self._reply(self._field(rec, self.field_chosen), self.field_chosen)
            rejected = self._reply(self._field(rec, self.field_rejected), self.field_rejected)
        prompt_text = render(self.template, prompt, self.special_tokens, True)[0]
        return (prompt_text, self._reply_text(chosen, self.field_chosen),
                self._reply_text(rejected, self.field_rejected))
