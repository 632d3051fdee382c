"""A Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``) read with
the ``tokenizers`` package (the ``[hf]`` extra), with BOS/EOS from the model's config and the
tokenizer's own chat template (``tokenizer_config.json``) when it has one; chat data is read by
:mod:`functional_pp.data.chat`.

See ``docs/data.md``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from functional_pp.core.optional import require
from functional_pp.data.chat import template_text
from functional_pp.data.utf8 import read_text

__all__ = ["HFTokenizer", "CHATML", "find_tokenizer_file"]

#: the ChatML template (``chat_template: chatml``; used when none is named and the tokenizer has none)
CHATML = template_text("chatml")


def find_tokenizer_file(path: str | os.PathLike) -> Path:
    """``path`` itself (a ``tokenizer.json``) or ``path/tokenizer.json``."""
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        tiktoken = sorted(c.name for c in p.glob("*.tiktoken")) if p.is_dir() else []
        hint = (f"; {p} holds {tiktoken[0]}, a tiktoken vocabulary read by remote code (Qwen (v1)'s "
                f"QWenTokenizer), which is not run: save it once as tokenizer.json (transformers' "
                f"PreTrainedTokenizerFast) and point tokenizer_config at it" if tiktoken else "")
        raise FileNotFoundError(f"no tokenizer.json at {p} (give a tokenizer.json or a Hugging Face "
                                f"directory holding one){hint}")
    return f


def _read_json(p: Path) -> dict:
    try:
        return json.loads(read_text(p)) if p.is_file() else {}
    except ValueError as exc:
        raise ValueError(f"{p} is not valid JSON: {exc}") from exc


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def _token_text(v: Any) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _own_template(value: Any, folder: Path) -> str | None:
    """The tokenizer's chat template, as transformers finds it: ``chat_template`` of
    ``tokenizer_config.json`` (a text, or a list of named ones: ``default``), else the
    ``chat_template.jinja`` file beside it."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if isinstance(value, str) and value:
        return value
    f = folder / "chat_template.jinja"
    return read_text(f) if f.is_file() else None


class HFTokenizer:
    """Encode text (and chats) to token ids; ``bos_id`` / ``eos_id`` from the model's
    ``config.json`` (``generation_config.json``, ``tokenizer_config.json`` as fallbacks)."""

    def __init__(self, path: str | os.PathLike, model_dir: str | os.PathLike | None = None):
        Tokenizer = require("tokenizers", "hf", "reading a Hugging Face tokenizer").Tokenizer
        self.file = find_tokenizer_file(path)
        self.dir = self.file.parent
        try:
            self.tok = Tokenizer.from_file(str(self.file))
        except Exception as exc:      # noqa: BLE001 - tokenizers raises a bare Exception, without the file
            raise ValueError(f"{self.file} is not a tokenizer the 'tokenizers' package can read ({exc}): "
                             f"the file is damaged or cut; copy it again from the model") from exc
        tcfg = _read_json(self.dir / "tokenizer_config.json")
        model_dir = Path(model_dir) if model_dir is not None else self.dir
        mcfg = {**_read_json(model_dir / "generation_config.json"), **_read_json(model_dir / "config.json")}
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._special(mcfg.get("bos_token_id"), _token_text(tcfg.get("bos_token")), "bos_token_id",
                                    model_dir)
        self.eos_id = self._special(mcfg.get("eos_token_id"), _token_text(tcfg.get("eos_token")), "eos_token_id",
                                    model_dir)
        self.add_bos = bool(tcfg.get("add_bos_token", self.bos_id is not None))
        #: transformers' padding side and length limit of this tokenizer (tokenizer_config.json)
        self.padding_side = str(tcfg.get("padding_side") or "right")
        limit = tcfg.get("model_max_length")
        self.model_max_length = int(limit) if isinstance(limit, (int, float)) and 0 < limit < 1e12 else None
        self.chat_template: str | None = _own_template(tcfg.get("chat_template"), self.dir)
        smap = {**_read_json(self.dir / "special_tokens_map.json"), **tcfg}
        #: the special tokens a chat template sees as variables (transformers' special_tokens_map)
        self.special_tokens = {k: _token_text(smap.get(k)) for k in _SPECIAL_KEYS
                               if isinstance(_token_text(smap.get(k)), str)}
        #: the tokenizer's own EOS (tokenizer_config.json), which chat data trains after a turn
        #: as Axolotl does (``eos_id`` comes from the model's config and separates documents)
        eos_text = self.special_tokens.get("eos_token")
        self.chat_eos_id = self.tok.token_to_id(eos_text) if eos_text else self.eos_id

    def add_tokens(self, tokens: list) -> int:
        """Axolotl's ``tokens``: add each text not yet in the vocabulary as one token (not
        normalized, not stripped) after the existing ids; returns how many were added."""
        AddedToken = require("tokenizers", "hf", "adding tokens (tokens:)").AddedToken
        before = self.vocab_size
        self.tok.add_tokens([AddedToken(str(t), lstrip=False, rstrip=False, normalized=False) for t in tokens])
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))
        return self.vocab_size - before

    def save(self, folder: str | os.PathLike) -> Path:
        """Write this tokenizer (with added tokens) to ``folder``: its tokenizer.json and the
        other tokenizer files of its directory."""
        import shutil
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (self.dir / name).is_file():
                shutil.copyfile(self.dir / name, out / name)
        self.tok.save(str(out / "tokenizer.json"))
        return out

    def set_special_tokens(self, tokens: dict) -> None:
        """Axolotl's ``special_tokens``: existing tokens made the tokenizer's BOS / EOS / ...
        (EOS ends each document and is the chat end-of-turn token); a token that is not one
        token of the vocabulary raises (adding tokens is not supported)."""
        for key, text in tokens.items():
            i = self.tok.token_to_id(text)
            if i is None:
                raise ValueError(f"special_tokens.{key}: {text!r} is not a token of {self.file} "
                                 f"(add it to the vocabulary with tokens: [{text!r}])")
            self.special_tokens[key] = text
            if key == "eos_token":
                self.eos_id = self.chat_eos_id = int(i)
            elif key == "bos_token":
                self.bos_id = int(i)

    def _special(self, token_id: Any, text: str | None, key: str, model_dir: Path) -> int | None:
        """The id of a special token: the model config's ``key`` (checked against the vocabulary: an
        EOS id beyond it separated every packed document with an id the model has no row for, and
        the run stopped at its first step naming the data), else the tokenizer's ``text``."""
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if token_id is not None:
            if not 0 <= int(token_id) < self.vocab_size:
                raise ValueError(f"{key}: {token_id} in {model_dir / 'config.json'} (or generation_config.json) is "
                                 f"outside the tokenizer's vocabulary of {self.vocab_size} ids ({self.file}); fix "
                                 f"{key} there (the tokenizer's own {text!r} is id "
                                 f"{self.tok.token_to_id(text) if text else None})")
            return int(token_id)
        if text is not None:
            return self.tok.token_to_id(text)
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_as_transformers(self, text: str) -> list[int]:
        """Token ids of ``text`` as transformers' ``tokenizer(text)``: with the special tokens the
        tokenizer's post-processor adds (a Llama tokenizer's BOS)."""
        return self.tok.encode(text, add_special_tokens=True).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` and each token's character span."""
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def token_to_id(self, text: str) -> int | None:
        """The id of a single token written ``text`` (None: it is not one token)."""
        i = self.tok.token_to_id(text)
        if i is not None:
            return int(i)
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                               skip_special_tokens=skip_special_tokens)

    def render(self, messages: list[dict], template: str | None) -> str:
        """A chat rendered with ``template`` as transformers' ``apply_chat_template`` does."""
        from functional_pp.data.chat import render
        return render(template or CHATML, messages, self.special_tokens)[0]

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.file)!r}, vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"
