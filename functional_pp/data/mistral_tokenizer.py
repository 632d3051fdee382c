"""A mistral-common tokenizer (``tekken.json`` or a sentencepiece ``tokenizer.model.v*``) read
with the ``mistral-common`` package (the ``[mistral]`` extra): Axolotl's
``tokenizer_use_mistral_common: true``. Chats are encoded by mistral-common itself
(``MistralTokenizer.encode_chat_completion`` in fine-tuning mode, the way Axolotl's
``HFMistralTokenizer`` does), not by a chat template; the trained tokens are found as for a
template (:func:`functional_pp.data.chat.tokenize_chat`). Same interface as
:class:`functional_pp.data.tokenizer.HFTokenizer`.

See ``docs/data.md`` ("mistral-common tokenizers").
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from functional_pp.core.optional import require

__all__ = ["MistralCommonTokenizer", "find_mistral_tokenizer_file"]

_FEATURE = "tokenizer_use_mistral_common"
#: message keys mistral-common's chat messages take
_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def find_mistral_tokenizer_file(path: str | os.PathLike) -> Path:
    """``path`` itself (a tokenizer file) or the mistral-common tokenizer file in the directory
    ``path`` (``tekken.json`` first, else a ``tokenizer.model.v*``: mistral-common's choice)."""
    p = Path(path)
    if p.is_file():
        return p
    utils = require("mistral_common.tokens.tokenizers.utils", "mistral", _FEATURE)
    files = [str(f) for f in sorted(p.iterdir())] if p.is_dir() else []
    try:
        return Path(utils.get_one_valid_tokenizer_file(files))
    except ValueError:
        raise FileNotFoundError(f"no mistral-common tokenizer (tekken.json or tokenizer.model.v*) at {p}: "
                                f"give tokenizer: PATH of one, or remove tokenizer_use_mistral_common") from None


class MistralCommonTokenizer:
    """Encode text and chats with mistral-common; BOS / EOS are the tokenizer's own."""

    #: no chat template: mistral-common encodes chats itself (chat_template is refused beside it)
    chat_template = None

    def __init__(self, path: str | os.PathLike):
        mistral = require("mistral_common.tokens.tokenizers.mistral", "mistral", _FEATURE)
        validator = require("mistral_common.protocol.instruct.validator", "mistral", _FEATURE)
        self.file = find_mistral_tokenizer_file(path)
        self.dir = self.file.parent
        try:        # fine-tuning mode checks a chat ends with the reply; test mode leaves it open
            self._train = mistral.MistralTokenizer.from_file(str(self.file), mode=validator.ValidationMode.finetuning)
            self._prompt = mistral.MistralTokenizer.from_file(str(self.file), mode=validator.ValidationMode.test)
        except Exception as exc:      # noqa: BLE001 - mistral-common raises assertion / own errors
            raise ValueError(f"{self.file} is not a tokenizer mistral-common can read ({type(exc).__name__}: "
                             f"{exc})") from exc
        self.tok = self._train.instruct_tokenizer.tokenizer
        self.vocab_size = int(self.tok.n_words)
        self.bos_id = int(self.tok.bos_id)
        self.eos_id = self.chat_eos_id = int(self.tok.eos_id)
        self.add_bos = True
        self.special_tokens = {"bos_token": self.tok.id_to_piece(self.bos_id),
                               "eos_token": self.tok.id_to_piece(self.eos_id)}
        self.version = str(self.tok.version.value)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS / EOS)."""
        return list(self.tok.encode(text, bos=False, eos=False))

    def encode_offsets(self, text: str):
        raise ValueError("mistral-common tokenizers give no character offsets (no chat template "
                         "{% generation %} marks with tokenizer_use_mistral_common)")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """Token ids of a chat as mistral-common encodes it (``encode_chat_completion``; with
        ``add_generation_prompt`` the chat may end on a user turn, as Axolotl's test mode)."""
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        msgs = []
        for i, m in enumerate(messages):
            other = sorted(k for k in m if k not in _MESSAGE_KEYS)
            if other:
                raise ValueError(f"message {i + 1} has {other}, which mistral-common's chat messages do not "
                                 f"take (they take {list(_MESSAGE_KEYS)}); remove them or use the model's "
                                 f"Hugging Face tokenizer")
            msgs.append({k: m[k] for k in _MESSAGE_KEYS if k in m})
        enc = self._prompt if add_generation_prompt else self._train
        try:
            return list(enc.encode_chat_completion(ChatCompletionRequest(messages=msgs)).tokens)
        except Exception as exc:      # noqa: BLE001 - pydantic's and mistral-common's own errors
            raise ValueError(f"mistral-common refused the chat ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0]})") from exc

    def token_to_id(self, text: str) -> int | None:
        """The id of a single token written ``text`` (a control token such as ``</s>``, or one
        ordinary token); None: it is not one token."""
        try:
            return int(self.tok.get_special_token(text))
        except Exception:             # noqa: BLE001 - not a control token
            ids = self.encode(text)
            return ids[0] if len(ids) == 1 else None

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        policy = SpecialTokenPolicy.IGNORE if skip_special_tokens else SpecialTokenPolicy.KEEP
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], special_token_policy=policy)

    def add_tokens(self, tokens: list) -> int:
        raise ValueError("tokens: adding tokens to a mistral-common tokenizer is not supported (as in "
                         "Axolotl): remove tokens or tokenizer_use_mistral_common")

    def set_special_tokens(self, tokens: dict) -> None:
        raise ValueError("special_tokens: a mistral-common tokenizer's special tokens are its own (as in "
                         "Axolotl): remove special_tokens or tokenizer_use_mistral_common")

    def save(self, folder: str | os.PathLike) -> Path:
        """Copy the tokenizer file into ``folder``."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.file, out / self.file.name)
        return out

    def __repr__(self) -> str:
        return (f"MistralCommonTokenizer({str(self.file)!r}, {self.version}, vocab={self.vocab_size}, "
                f"bos={self.bos_id}, eos={self.eos_id})")
