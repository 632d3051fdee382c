"""The earlier single module of transformations; its names now live in base, combine, adam,
clipping and masking and are re-exported here so that imports keep working."""
from __future__ import annotations

from functional_pp.optim.adam import ScaleByAdamState, scale_by_adam
from functional_pp.optim.base import (EmptyState, GradientTransformation, PyTree, ScalarOrSchedule,
                                      ScaleByScheduleState, Schedule, TraceState, apply_updates, identity, scale,
                                      scale_by_learning_rate, scale_by_schedule, state_like_params, trace, tree_map)
from functional_pp.optim.clipping import NormReducer, clip_by_global_norm, global_norm
from functional_pp.optim.combine import chain
from functional_pp.optim.masking import (Mask, MaskOrFn, add_decayed_weights, decay_mask_by_ndim, mask_by_path,
                                         resolve_mask)
from functional_pp.optim.optimizers import scale_by_adamw

__all__ = ["PyTree", "Schedule", "ScalarOrSchedule", "Mask", "MaskOrFn", "NormReducer", "GradientTransformation",
           "EmptyState", "ScaleByScheduleState", "ScaleByAdamState", "TraceState", "tree_map", "apply_updates",
           "chain", "identity", "scale", "scale_by_schedule", "scale_by_learning_rate", "scale_by_adam",
           "scale_by_adamw", "add_decayed_weights", "trace", "clip_by_global_norm", "global_norm",
           "decay_mask_by_ndim", "mask_by_path", "resolve_mask", "state_like_params"]
