"""Axolotl's ``llmcompressor:`` key (its LLMCompressorPlugin): an llm-compressor recipe whose only
modifier is ``ConstantPruningModifier`` (sparse fine-tuning: the targeted weights' zeros stay zero,
``optim.keep_zeros``). Read here into the targets; anything else is refused by name."""
from __future__ import annotations

import re
from typing import Any, Callable

__all__ = ["PLUGIN", "MODIFIER", "SparseRecipe", "read_recipe"]

PLUGIN = "axolotl.integrations.llm_compressor.LLMCompressorPlugin"
MODIFIER = "ConstantPruningModifier"
_KEYS = ("recipe", "save_compressed")
_MODIFIER_ARGS = ("targets", "start", "end", "update")


class SparseRecipe:
    """The targets of a recipe's ConstantPruningModifier: llm-compressor's, each ``re:REGEX``
    (matched from the start of a Hugging Face parameter name, ``re.match``) or an exact name."""

    def __init__(self, targets: list[str], save_compressed: bool):
        self.targets, self.save_compressed = targets, save_compressed
        self._regexes = [re.compile(t[3:]) for t in targets if t.startswith("re:")]
        self._names = {t for t in targets if not t.startswith("re:")}

    def matches(self, hf_name: str) -> bool:
        """Whether a target names the parameter ``hf_name`` (e.g. ``model.layers.0.self_attn.q_proj.weight``)."""
        return hf_name in self._names or any(r.match(hf_name) for r in self._regexes)

    def predicate(self, hf_name_of: Callable[[str], str | None]) -> Callable[[str], bool]:
        """``targets(path)`` over our tree paths, given their Hugging Face names."""
        def targeted(path: str) -> bool:
            name = hf_name_of(path)
            return name is not None and self.matches(name)
        return targeted


def read_recipe(value: Any) -> SparseRecipe:
    """The ``llmcompressor:`` mapping as a :class:`SparseRecipe`; a ``ValueError`` naming the key
    and what to write instead for anything not built (other modifiers, a recipe given as text or
    a file, a start other than 0)."""
    if not isinstance(value, dict):
        raise ValueError(f"llmcompressor must be a mapping {{recipe: ..., save_compressed: ...}}, got {value!r}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"llmcompressor.{unknown[0]} is not an option here (options: {', '.join(_KEYS)}): remove it")
    recipe = value.get("recipe")
    if not isinstance(recipe, dict) or not recipe:
        raise ValueError(f"llmcompressor.recipe must be a recipe written as a mapping (stage: {{*_modifiers: "
                         f"{{{MODIFIER}: {{targets: [...], start: 0}}}}}}), got {recipe!r} (a recipe given as "
                         f"text or a file is not read: write it inline)")
    targets: list[str] = []
    for stage, groups in recipe.items():
        if not isinstance(groups, dict):
            raise ValueError(f"llmcompressor.recipe.{stage} must be a mapping of modifier groups (*_modifiers), "
                             f"got {groups!r}")
        for group, modifiers in groups.items():
            where = f"llmcompressor.recipe.{stage}.{group}"
            if not str(group).endswith("_modifiers") or not isinstance(modifiers, dict):
                raise ValueError(f"{where}: a stage holds groups named *_modifiers, each a mapping of modifiers "
                                 f"(got {group!r}: {modifiers!r})")
            for name, args in modifiers.items():
                if name != MODIFIER:
                    raise ValueError(f"{where}.{name}: only {MODIFIER} (sparse fine-tuning: zeros kept) is built "
                                     f"here; {name} is not: remove it")
                targets += _modifier_targets(f"{where}.{name}", args)
    if not targets:
        raise ValueError(f"llmcompressor.recipe holds no {MODIFIER}: give one with its targets")
    save = value.get("save_compressed", False)
    if not isinstance(save, bool):
        raise ValueError(f"llmcompressor.save_compressed must be true or false, got {save!r}")
    return SparseRecipe(targets, save)


def _modifier_targets(where: str, args: Any) -> list[str]:
    if not isinstance(args, dict):
        raise ValueError(f"{where} must be a mapping {{targets: [...], start: 0}}, got {args!r}")
    unknown = sorted(set(args) - set(_MODIFIER_ARGS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not an argument of {MODIFIER} here (arguments: targets, start): "
                         f"remove it")
    if args.get("start", 0) not in (0, 0.0, None):
        raise ValueError(f"{where}.start: {args['start']!r}: only start 0 is built (the mask taken from the loaded "
                         f"weights before the first step): set start: 0")
    if args.get("end", -1) not in (-1, None):
        raise ValueError(f"{where}.end: {args['end']!r}: the mask is kept to the end of training here: remove end")
    if args.get("update") not in (None,):
        raise ValueError(f"{where}.update: {args['update']!r}: the mask is taken once: remove update")
    targets = args.get("targets")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where}.targets must be a parameter name or 're:REGEX', or a list of them, "
                         f"got {args.get('targets')!r}")
    for t in targets:
        if t.startswith("re:"):
            try:
                re.compile(t[3:])
            except re.error as exc:
                raise ValueError(f"{where}.targets: {t!r} is not a regex ({exc})") from None
    return targets
