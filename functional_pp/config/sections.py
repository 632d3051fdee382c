"""The sections of the training config (``model``, one ``datasets`` entry, ``data``,
``logging``, ``checkpoint``), declared as dataclasses whose fields carry their help text;
read by :mod:`functional_pp.config` with the validator of :mod:`functional_pp.config.schema`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from functional_pp.config.schema import ConfigError, Issues, fld, parse_section, suggest
from functional_pp.models.family import UnknownFamilyError, get_family

__all__ = ["ModelConfig", "DatasetConfig", "DataConfig", "LoggingConfig", "CheckpointConfig", "PRESETS",
           "DEFAULT_FAMILY"]

DEFAULT_FAMILY = "llama"
PRESETS = tuple(get_family(DEFAULT_FAMILY).presets)     # llama's: tiny, 1b, 8b, 70b, then the other families


# ----------------------------------------------------------------------------- sections
@dataclass
class ModelConfig:
    """``family`` (a registered model family, :mod:`functional_pp.models.family`), its
    ``preset`` and overrides of the family's config fields (training from scratch;
    ``base_model`` starts from a Hugging Face directory instead)."""

    preset: str = fld("tiny", "model preset (llama: tiny | 1b | 8b | 70b | mistral-7b | qwen2.5-0.5b | "
                              "qwen2.5-7b | qwen3-0.6b | qwen3-8b | phi3-mini | gemma2-2b | gemma3-1b); other keys of this "
                              "section override fields of the family's config "
                              "(llama: functional_pp.models.llama.Config)")
    overrides: dict = fld(help="", factory=dict)
    family: str = fld(DEFAULT_FAMILY, "the model family (registered in functional_pp.models)")

    @classmethod
    def from_value(cls, value: Any, issues: Issues | None = None) -> "ModelConfig":
        own = issues is None
        issues = issues if issues is not None else Issues()
        out = cls._parse(value, issues)
        if own:
            issues.raise_if_any()
        return out

    @classmethod
    def _parse(cls, value: Any, issues: Issues) -> "ModelConfig":
        if value is None:
            return cls()
        if isinstance(value, str):
            value = {"preset": value}
        if not isinstance(value, Mapping):
            issues.add(f"'model' must be a preset name or a mapping, got {value!r}")
            return cls()
        d = dict(value)
        name = d.pop("family", DEFAULT_FAMILY)
        try:
            family = get_family(name)
        except UnknownFamilyError as exc:
            issues.add(f"model.family: {exc}")
            return cls()
        preset = d.pop("preset", "tiny")
        if preset not in family.presets:
            presets = tuple(family.presets)
            issues.add(f"model.preset {preset!r} is not a preset{suggest(str(preset), presets)} "
                       f"(presets: {', '.join(presets)})")
            preset = presets[0]
        return cls(preset, parse_section(family.config_class, d, "model", issues), name)

    def build(self):
        """The family's model config (:class:`functional_pp.models.llama.Config` for llama)."""
        try:
            return get_family(self.family).build_config(self.preset, **self.overrides)
        except (TypeError, ValueError, UnknownFamilyError) as exc:
            raise ConfigError(f"model: {exc}") from exc

    def to_dict(self) -> dict:
        family = {} if self.family == DEFAULT_FAMILY else {"family": self.family}
        return {**family, "preset": self.preset, **self.overrides}


@dataclass
class DatasetConfig:
    """One entry of ``datasets:`` (Axolotl's shape); see ``functional_pp.data.formats``."""

    path: str = fld(None, "a file or directory: .txt files, .jsonl/.json, .parquet, a HF "
                          "`datasets` save_to_disk directory, or pre-tokenized .npy/.bin")
    type: str | dict | None = fld(None, "text | completion | alpaca (alpaca:chat, alpaca:phi, alpaca:chatml) | "
                                        "input_output | chat_template | pretokenized "
                                        "(default: from the file: text files -> text, jsonl -> "
                                        "completion, .npy/.bin -> pretokenized); rl: a preference type "
                                        "(chatml.*, llama3.*, chat_template.*) or a mapping (Axolotl's "
                                        "user-defined type: field_prompt, field_system, field_chosen, "
                                        "field_rejected, prompt_format, chosen_format, rejected_format)")
    field: str = fld("text", "completion/text: the field that holds each record's text")
    field_messages: str = fld("messages", "chat_template: the field with the list of messages")
    message_property_mappings: dict | None = fld(None, "chat_template: the template's message keys "
                                                       "-> the data's, e.g. {role: from, content: "
                                                       "value} (default role -> role, content -> "
                                                       "content; ShareGPT from/value is recognised)")
    field_thinking: str | None = fld(None, "chat_template: a message's key holding the reasoning "
                                           "trace (default reasoning_content)")
    template_thinking_key: str | None = fld(None, "chat_template: the key the chat template reads the "
                                                  "reasoning from (default reasoning_content; gpt-oss's: "
                                                  "thinking)")
    message_field_role: str | None = fld(None, "chat_template: a message's role key (older "
                                               "spelling of message_property_mappings.role)")
    message_field_content: str | None = fld(None, "chat_template: a message's content key (older "
                                                  "spelling of message_property_mappings.content)")
    roles: dict | None = fld(None, "chat_template: the template's role -> the data's roles, e.g. "
                                   "{user: [human], assistant: [gpt]}; replaces the default map "
                                   "human/user -> user, gpt/assistant -> assistant, system, tool")
    roles_to_train: list | None = fld(None, "chat_template: roles whose turns are trained "
                                            "(default [assistant])")
    train_on_eos: Literal["all", "turn", "last", "none"] = fld(
        "turn", "chat_template: which end-of-turn EOS tokens are trained: after trained turns, "
                "all, the last one, none")
    train_on_eot: Literal["all", "turn", "last", "none"] | None = fld(
        None, "chat_template: the same for eot_tokens (default: train_on_eos)")
    drop_system_message: bool = fld(False, "chat_template: leave out a leading system message")
    field_system: str = fld("system", "chat_template: a record's system prompt field, put first "
                                      "when the messages have no system message")
    message_field_training: str | None = fld(None, "chat_template: a message key whose true / "
                                                   "false says whether that turn is trained")
    chat_template: str | None = fld(None, "chat_template: this dataset's template (a name: "
                                          "chatml, llama3, ...; tokenizer_default; jinja); "
                                          "default: the top-level chat_template")
    chat_template_jinja: str | None = fld(None, "chat_template: jinja: the template text or a "
                                                ".jinja file")
    field_prompt: str = fld("prompt", "rl (preference pairs, type omitted): the prompt field")
    field_chosen: str = fld("chosen", "rl (preference pairs, type omitted): the chosen completion's field")
    field_rejected: str = fld("rejected", "rl (preference pairs, type omitted): the rejected completion's field")
    field_completion: str = fld("completion", "rl: kto (type omitted): the completion's field")
    field_label: str = fld("label", "rl: kto: the field saying whether the completion is desirable (true / false)")
    step_separator: str | None = fld(None, "stepwise_supervised: the text after each step whose last token "
                                           "carries the step's label (default \"\\n\")")
    train_on_last_step_only: bool = fld(False, "stepwise_supervised: label only the last step (training rows)")
    max_completion_length: int | None = fld(None, "stepwise_supervised: cut the steps' tokens to this many")
    split: str = fld("train", "HF `datasets` on disk: the split to read")
    pattern: str | None = fld(None, "directories: the file pattern (default *.txt)")
    dtype: str | None = fld(None, "pretokenized .bin: the token dtype (uint16 | uint32 | int32; default "
                                  "uint16 when the tokenizer's ids fit in it, else uint32)")
    ds_type: str | None = fld(None, "json | parquet | text | arrow: the file format when the "
                                    "extension does not say")


@dataclass
class DataConfig:
    """The single corpus used when there is no ``datasets:`` list."""

    path: str | None = fld(None, "text file, directory of *.txt or .jsonl; null: the Python "
                                 "standard library's source, as bytes")
    kind: Literal["auto", "stdlib", "text", "dir", "jsonl"] = fld("auto", "how to read path")
    tokenizer: str | None = fld(None, "a tokenizer.json or a directory holding it (default: bytes, or base_model's)")
    max_bytes: int | None = fld(None, "cap on the raw text read (null: no cap)")
    pattern: str | None = fld(None, "directories: the file pattern")
    text_field: str = fld("text", "jsonl: the field with each record's text")


@dataclass
class LoggingConfig:
    """Where outputs go and how often the progress line is printed."""

    output_dir: str | None = fld(None, "run directory (default runs/<config name>); alias "
                                       "output_dir at the top level")
    log_every: int = fld(10, "print the progress line every N steps (alias logging_steps)")
    plot: bool = fld(True, "write loss.png at the end (needs matplotlib)")


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    save_every: int = fld(0, "save every N steps, 0: never periodically (alias save_steps)")
    keep_last: int | None = fld(3, "keep the newest K checkpoints, null: all (alias "
                                   "save_total_limit)")
    save_final: bool = fld(True, "also save when training ends")
    save_best: bool = fld(False, "also save after each evaluation whose held-out loss is the best so far "
                                 "(Axolotl's save_strategy: best; greater_is_better: true inverts it)")
