"""A small generic validator for config sections declared as dataclasses.

A section is a ``@dataclass`` whose fields carry their help text in ``metadata["help"]``;
the field's type annotation is the schema (``int``, ``float``, ``bool``, ``str``, ``dict``,
``list``, ``Literal[...]``, unions with ``None``, a nested dataclass given as a mapping of its
fields). :func:`parse_section` checks a mapping against it and records *every* problem in an
:class:`Issues` list instead of stopping at the first, so a file's errors are reported at once
(see ``docs/config.md``).

Blank values (``save_steps:`` with nothing, YAML's null) mean unset for a field that has no
null value: the default is used, as Axolotl does. Where null is a value (``max_grad_norm:
null``: no clipping) it keeps that meaning.

Numbers: YAML 1.1 (PyYAML) reads ``1e-3`` and ``5e10`` as strings; for numeric fields such
strings are accepted as numbers. Booleans are never numbers and numbers never booleans.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Literal, Mapping

__all__ = ["Issues", "ConfigError", "parse_section", "check_value", "accepts_none", "field_help", "suggest",
           "help_text", "fld"]


class ConfigError(ValueError):
    """A problem with the training config, found before any work; says what to change.
    ``problems`` lists every problem found (the message shows them all)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


class Issues:
    """Problems collected while reading a config; :meth:`raise_if_any` reports them all."""

    def __init__(self, source: str = ""):
        self.source = source
        self.items: list[str] = []

    def add(self, message: str) -> None:
        if message not in self.items:
            self.items.append(message)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if not self.items:
            return
        if len(self.items) == 1:
            raise ConfigError(self.items[0], list(self.items))
        where = f" in {self.source}" if self.source else ""
        raise ConfigError(f"{len(self.items)} problems{where}:\n" +
                          "\n".join(f"  - {m}" for m in self.items), list(self.items))


def fld(default: Any = dataclasses.MISSING, help: str = "", factory: Any = None) -> Any:
    """A dataclass field with help text (``factory`` for mutable defaults)."""
    meta = {"help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def suggest(key: str, valid: list[str] | tuple[str, ...]) -> str:
    """``; did you mean 'x'?`` for a close match (a valid name the key ends with first:
    ``num_layers`` -> ``layers``), else the list of valid names."""
    ends = [v for v in valid if str(key).endswith("_" + v)]
    hint = [max(ends, key=len)] if ends else difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.6)
    return f"; did you mean {hint[0]!r}?" if hint else f" (valid: {', '.join(sorted(valid))})"


_EXP_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            dict: "a mapping", list: "a list", type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


_FAIL = object()


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` as type ``tp``, or ``_FAIL``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            out = _coerce(value, arg)
            if out is not _FAIL:
                return out
        return _FAIL
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, str) and value.lower() in choices:
            return value.lower()
        return value if not isinstance(value, str) and value in choices else _FAIL
    if tp is type(None):
        return None if value is None else _FAIL
    if tp is Any:
        return value
    if tp is bool:
        return value if isinstance(value, bool) else _FAIL
    if tp is int:
        if isinstance(value, bool):
            return _FAIL
        if isinstance(value, int):
            return value
        if isinstance(value, str) and _EXP_NUMBER.match(value.strip()):
            f = float(value)
            return int(f) if f.is_integer() else _FAIL
        return _FAIL
    if tp is float:
        if isinstance(value, bool):
            return _FAIL
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and _EXP_NUMBER.match(value.strip()):
            return float(value)
        return _FAIL
    if tp is str:
        return value if isinstance(value, str) else _FAIL
    if tp is dict or origin is dict:
        return dict(value) if isinstance(value, Mapping) else _FAIL
    if tp is list or origin is list:
        return list(value) if isinstance(value, (list, tuple)) else _FAIL
    if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(tp)}        # a nested section (rope_scaling)
        return dict(value) if set(value) <= names else _FAIL
    return value if isinstance(value, tp) else _FAIL


def accepts_none(tp: Any) -> bool:
    """Whether null is a value of type ``tp`` (else a blank value means unset)."""
    return _coerce(None, tp) is not _FAIL


def check_value(name: str, value: Any, tp: Any, issues: Issues) -> Any:
    """``value`` converted to ``tp``; records a problem (and returns ``_FAIL``) otherwise."""
    out = _coerce(value, tp)
    if out is _FAIL:
        if typing.get_origin(tp) is Literal and isinstance(value, str):
            issues.add(f"{name}: {value!r} is not supported{suggest(value.lower(), typing.get_args(tp))}")
        else:
            issues.add(f"{name} must be {_type_name(tp)}, got {value!r}")
    return out


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=False)


def parse_section(cls, d: Any, where: str, issues: Issues, *, skip: tuple[str, ...] = ()) -> dict:
    """Checked keyword arguments for ``cls`` from mapping ``d`` (problems go to ``issues``).
    ``skip`` names fields the caller parses itself."""
    if d is None:
        return {}
    prefix = f"{where}." if where else ""
    if not isinstance(d, Mapping):
        issues.add(f"'{where}' must be a mapping of keys to values, got {d!r}")
        return {}
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name in hints and not f.name.startswith("_")]
    out = {}
    for key, value in d.items():
        if key in skip:
            continue
        if key not in names:
            hint = suggest(str(key), names)
            if not hint.startswith(";") and len(names) > 12:     # no close match: no 60-key list
                hint = " (not a key of this trainer; `functional-pp train --help` lists them)"
            issues.add(f"unknown key '{prefix}{key}'{hint}")
            continue
        if value is None and not accepts_none(hints[key]):
            continue                  # a blank value (`save_steps:`) means unset, as in Axolotl
        v = check_value(f"{prefix}{key}", value, hints[key], issues)
        if v is not _FAIL:
            out[key] = v
    return out


def field_help(cls) -> list[tuple[str, str, Any, str]]:
    """``(name, type, default, help)`` of every documented field of ``cls``."""
    hints = _hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help")
        if not text:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:   # type: ignore[misc]
            default = f.default_factory()                      # type: ignore[misc]
        else:
            default = None
        rows.append((f.name, _type_name(hints[f.name]), default, text))
    return rows


def help_text(sections: list[tuple[str, Any]], width: int = 100) -> str:
    """Per-key help of every section (``(title, dataclass)`` pairs), defaults included."""
    import textwrap
    lines = []
    for title, cls in sections:
        lines.append(f"{title}:")
        for name, tname, default, text in field_help(cls):
            if dataclasses.is_dataclass(default):
                shown = ""
            else:
                shown = f" (default: {default!r})" if default not in ({}, []) else ""
            body = textwrap.fill(f"{text} [{tname}]{shown}", width - 6, initial_indent="      ",
                                 subsequent_indent="      ")
            lines.append(f"  {name}\n{body}")
    return "\n".join(lines)
