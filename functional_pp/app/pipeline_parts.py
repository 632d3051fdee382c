"""What a run's pipeline splits over its stages (docs/pipelines.md): the model family's layers
and first- / last-stage parameters, and those of each whole copy of the model in the tree (a
preference run's frozen reference). Used by the loop's pipeline step and the rollout's estimate
(app/rollout_memory.py)."""
from __future__ import annotations

from typing import Any

__all__ = ["pipeline_parts"]


def pipeline_parts(family: Any, model_cfg: Any, copies: tuple[str, ...] = ()) -> tuple[tuple[str, ...], ...]:
    """``(layer lists, first-stage, last-stage parameter prefixes)`` a run's pipeline splits: the
    family's layers and ends, and those of each whole copy of the model under ``copies``' keys."""
    first, last = family.pipeline_ends(model_cfg) if family.pipeline_ends is not None else ((), ())
    layers = ("layers", *(f"{c}.layers" for c in copies))
    first, last = (tuple(ends) + tuple(f"{c}.{n}" for c in copies for n in ends) for ends in (first, last))
    return layers, first, last
