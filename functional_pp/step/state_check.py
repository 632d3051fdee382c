"""Which part of a training state does not belong to its step (docs/bad_inputs.md §1b).

A step run on an optimizer state or parameters of another tree (another model size, another
``step.init``) failed deep inside torch (``The size of tensor a (16) must match the size of
tensor b (8)``). :class:`TrainStep` records the structure and local shapes of the state its
``init`` made on each device and, only when a step fails, compares the state it was given
with them: no cost on the steps that run."""
from __future__ import annotations

from typing import Any

import torch

from functional_pp.core.tree import leaves_with_paths

_PARTS = ("params", "opt_state")


def state_signature(state: dict) -> dict[str, tuple | None]:
    """``{"params.<path>": local shape, "opt_state.<path>": ...}`` of ``state`` (None for a
    leaf that is not a tensor)."""
    out: dict[str, tuple | None] = {}
    for part in _PARTS:
        for path, leaf in leaves_with_paths(state.get(part)):
            data = getattr(leaf, "data", leaf)
            out[f"{part}.{path}" if path else part] = tuple(data.shape) if isinstance(data, torch.Tensor) else None
    return out


def state_mismatch(recorded: dict[str, tuple | None], state: Any) -> str | None:
    """A message naming how ``state`` differs from the ``recorded`` signature of the state
    ``step.init`` made, or None when it matches (the failure lies elsewhere)."""
    if not isinstance(state, dict) or not all(p in state for p in _PARTS):
        return None
    given = state_signature(state)
    if given == recorded:
        return None
    missing = [k for k in recorded if k not in given]
    extra = [k for k in given if k not in recorded]
    shapes = [f"{k}: shape {given[k]}, step.init made {recorded[k]}" for k in recorded
              if k in given and given[k] != recorded[k]]
    parts = []
    if shapes:
        parts.append(f"{len(shapes)} leaves of another shape ({'; '.join(shapes[:3])}"
                     f"{'; ...' if len(shapes) > 3 else ''})")
    if missing:
        parts.append(f"missing {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}")
    if extra:
        parts.append(f"not made by step.init: {', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}")
    which = sorted({k.split(".", 1)[0] for k in [*missing, *extra] + [s.split(":", 1)[0] for s in shapes]})
    return (f"the training state does not match the one this train_step's init made ({'; '.join(parts)}): "
            f"its {' and '.join(which)} belong to another parameter tree. Make the state with "
            f"step.init(params) of this model (or load a checkpoint of it), and keep each state's "
            f"opt_state with its params")
