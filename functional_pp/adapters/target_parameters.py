"""peft's ``target_parameters`` (Axolotl's ``lora_target_parameters``): LoRA on parameters that are
not linear modules, here transformers 5's fused expert tensors, mapped onto this model's expert
weights. ``mlp.experts.gate_up_proj`` ([E, 2F, H]: one adapter, gate and up rows sharing its A)
is the ``gate`` and ``up`` weights' adapters with ``up`` borrowing ``gate``'s ``lora_A``
(``LoraConfig.shared_a``); ``mlp.experts.down_proj`` is ``down``'s; ``gate_proj`` / ``up_proj``
(families that keep them apart) are ``gate`` / ``up``. A ``model.layers.N.`` prefix keeps to
that layer, as peft's suffix match does."""
from __future__ import annotations

import re

__all__ = ["EXPERT_PARAMETERS", "expert_targets"]

#: the last name of a peft target parameter -> our expert weights it covers
EXPERT_PARAMETERS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",), "gate_proj": ("gate",),
                     "up_proj": ("up",)}

_FORM = re.compile(r"^(?:(?:model\.)?(?:language_model\.)?(layers\.\d+)\.)?(?:mlp\.)?experts\.(\w+)$")


def expert_targets(names: list[str] | tuple[str, ...]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """``(module names for target_modules, shared_a pairs)`` of peft ``target_parameters``
    ``names``; a name that is not an expert tensor of the forms above raises naming the forms."""
    modules: list[str] = []
    shared: list[tuple[str, str]] = []
    for name in names:
        m = _FORM.match(str(name))
        if m is None or m.group(2) not in EXPERT_PARAMETERS:
            raise ValueError(f"lora_target_parameters: {name!r} is not a mixture-of-experts tensor this trainer "
                             f"adapts; give [LAYER_PREFIX.]mlp.experts.NAME with NAME one of "
                             f"{', '.join(EXPERT_PARAMETERS)} (e.g. mlp.experts.gate_up_proj, mlp.experts.down_proj)")
        prefix = f"{m.group(1)}.mlp." if m.group(1) else "mlp."
        parts = EXPERT_PARAMETERS[m.group(2)]
        modules += [prefix + p for p in parts]
        if len(parts) == 2:
            shared.append(parts)
    return tuple(dict.fromkeys(modules)), tuple(dict.fromkeys(shared))
