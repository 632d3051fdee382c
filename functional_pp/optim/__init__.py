"""optax-shaped functional optimizers over pytrees of torch tensors (docs/optim.md).

``base`` (the transformation type, scaling, momentum, applying updates), ``combine``
(``chain``), ``adam`` (``scale_by_adam``), ``adam8bit`` (8-bit moments), ``clipping`` (global norm), ``masking`` (masks,
weight decay), ``schedules`` (learning-rate schedules), ``layer_sampling`` (LISA), ``sparsity`` (zeros kept: sparse fine-tuning), ``optimizers`` (``sgd``, ``adamw``,
``from_config``), ``fused`` (in-place steps on torch's fused kernels), ``bounds`` (pre-update
bounds: new parameters shown finite before they are written)."""

from functional_pp.optim import schedules
from functional_pp.optim.adam import ScaleByAdamState, scale_by_adam
from functional_pp.optim.adam8bit import Quantized4, Quantized8, ScaleByAdam8bitState, scale_by_adam_4bit, scale_by_adam_8bit
from functional_pp.optim.base import (DECLINED, EmptyState, GradientTransformation, ScaleByScheduleState, TraceState,
                                      apply_updates, identity, in_place_step, returns_fresh, scale,
                                      scale_by_learning_rate, scale_by_schedule, state_like_params, trace, tree_map,
                                      update_bound, update_with)
from functional_pp.optim.clipping import NormReducer, clip_by_global_norm, global_norm
from functional_pp.optim.combine import chain
from functional_pp.optim.layer_sampling import LayerSamplingState, sample_layers
from functional_pp.optim.masking import add_decayed_weights, decay_mask_by_ndim, mask_by_path, resolve_mask
from functional_pp.optim.sparsity import KeepZerosState, keep_zeros
from functional_pp.optim.optimizers import (CONFIG_KEYS, adamw, adamw_4bit, adamw_8bit, from_config, make_schedule, scale_by_adamw,
                                            sgd)

__all__ = [
    "schedules", "GradientTransformation", "EmptyState", "ScaleByAdamState", "ScaleByScheduleState", "TraceState",
    "NormReducer", "tree_map", "apply_updates", "update_with", "update_bound", "in_place_step", "DECLINED", "returns_fresh", "chain", "identity", "scale", "scale_by_schedule",
    "scale_by_learning_rate", "scale_by_adam", "scale_by_adamw", "add_decayed_weights", "trace",
    "clip_by_global_norm", "global_norm", "decay_mask_by_ndim", "mask_by_path", "resolve_mask",
    "state_like_params", "sgd", "adamw", "adamw_8bit", "scale_by_adam_8bit", "ScaleByAdam8bitState", "Quantized8",
    "adamw_4bit", "scale_by_adam_4bit", "Quantized4",
    "make_schedule", "from_config", "CONFIG_KEYS", "sample_layers", "LayerSamplingState", "keep_zeros", "KeepZerosState",
]

_REMOVED = {
    "norm_reducer": "pass the reducer explicitly: optim.global_norm(tree, reducer) or "
                    "opt.update(grads, state, params, norm_reducer=fn)",
    "get_norm_reducer": "the reducer is no longer ambient: it is an argument of global_norm / clip_by_global_norm "
                        "or the norm_reducer= extra argument of update",
}


def __getattr__(name: str):
    if name in _REMOVED:
        raise AttributeError(f"functional_pp.optim.{name} was removed: {_REMOVED[name]} (docs/optim.md)")
    raise AttributeError(f"module 'functional_pp.optim' has no attribute {name!r}")
