"""A named value's part in FSDP, held by the value in one immutable record (``Named.role``):
whether it is a parameter (FSDP re-gathers it in backward instead of saving it), a tied one
(used at several sites, gathered once for all), and for a gathered parameter the recipe of its
gather (``gathered_from``: ``(shard, axes, dim, order)``, so backward can re-gather it). An
ordinary value has none (``None``). The ops ask the functions here instead of reading fields.

Mechanism: FSDP (a value's role: parameter, tied, gathered from its shard; eager).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ParamRole", "role", "is_param", "is_tied", "gathered_from", "is_gathered", "tied", "gathered",
           "keeps_relayout", "after_reshard", "of_view"]


@dataclass(frozen=True, slots=True)
class ParamRole:
    """What FSDP knows of a value's origin (docs/named_value.md); ``None`` for an ordinary value."""

    is_param: bool = False
    tied: bool = False
    gathered_from: tuple | None = None


PARAM = ParamRole(True)
TIED = ParamRole(True, True)


def role(is_param: bool = False, tied: bool = False, gathered_from: tuple | None = None) -> ParamRole | None:
    """The record of these fields: ``None`` for an ordinary value (none set), shared records for
    the common ones (a parameter, a tied parameter)."""
    if gathered_from is None:
        if not tied:
            return PARAM if is_param else None
        if is_param:
            return TIED
    return ParamRole(bool(is_param), bool(tied), gathered_from)


def is_param(r: ParamRole | None) -> bool:
    """A parameter (FSDP re-gathers it in backward)."""
    return r is not None and r.is_param


def is_tied(r: ParamRole | None) -> bool:
    """A parameter used at several sites, gathered once for all."""
    return r is not None and r.tied


def gathered_from(r: ParamRole | None) -> tuple | None:
    """``(shard, axes, dim, order)`` of a gathered parameter, else None."""
    return None if r is None else r.gathered_from


def is_gathered(r: ParamRole | None) -> bool:
    """A gathered parameter: an op on it runs in a re-gather scope, not saved for backward
    (parallel/fsdp/regather.py)."""
    return r is not None and r.gathered_from is not None


def tied(r: ParamRole | None) -> ParamRole:
    """The role of a value declared tied (``functional_pp.tied``): a tied parameter, its gather's recipe kept."""
    return role(is_param(r), True, gathered_from(r))


def gathered(r: ParamRole | None, recipe: tuple) -> ParamRole:
    """The role of a value FSDP's relayout gathered whole along one dimension: ``recipe``
    (``(shard, axes, dim, order)``) kept so that backward re-gathers it (parallel/fsdp/regather.py)."""
    return role(is_param(r), is_tied(r), recipe)


def keeps_relayout(r: ParamRole | None, gathered: bool) -> bool:
    """Whether a value's relayout may be kept with it (memoised): not where it ``gathered`` a
    parameter that is not tied (a cached gathered weight would live as long as its shard)."""
    return not (gathered and is_param(r)) or is_tied(r)


def after_reshard(r: ParamRole | None) -> ParamRole | None:
    """The role of a resharded value: a parameter stays one (FSDP's relayout adds the gather's
    recipe, parallel/fsdp/regather.py); tied and the old recipe are dropped."""
    return PARAM if is_param(r) else None


def of_view(r: ParamRole | None, data: torch.Tensor, base: torch.Tensor) -> ParamRole | None:
    """The role of ``data``, a view of a value's block ``base`` under other names or shape: the
    same, but a gather's recipe only while ``data`` shares ``base``'s storage."""
    if r is None or r.gathered_from is None or _root(data) is _root(base):
        return r
    return role(r.is_param, r.tied)


def _root(t: Any) -> Any:
    return t._base if t._base is not None else t
