"""optax-style functional optimizers over pytrees of torch tensors.

See :mod:`functional_pp.optim.transform` for the conventions (purity,
compile-friendliness, fp32 state mirroring the param tree).
"""

from . import schedules
from .optimizers import CONFIG_KEYS, adamw, from_config, make_schedule, sgd
from .transform import (
    EmptyState,
    GradientTransformation,
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    apply_updates,
    chain,
    clip_by_global_norm,
    decay_mask_by_ndim,
    get_norm_reducer,
    global_norm,
    identity,
    norm_reducer,
    resolve_mask,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    state_like_params,
    trace,
    tree_map,
)

__all__ = [
    "schedules",
    "GradientTransformation",
    "EmptyState",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "TraceState",
    "tree_map",
    "apply_updates",
    "chain",
    "identity",
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "scale_by_adam",
    "add_decayed_weights",
    "trace",
    "clip_by_global_norm",
    "global_norm",
    "norm_reducer",
    "get_norm_reducer",
    "decay_mask_by_ndim",
    "resolve_mask",
    "state_like_params",
    "sgd",
    "adamw",
    "make_schedule",
    "from_config",
    "CONFIG_KEYS",
]
