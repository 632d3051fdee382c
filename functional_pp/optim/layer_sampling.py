"""LISA (layer-wise importance sampling, Pan et al. 2024; Axolotl's ``lisa_*`` keys): every
``interval`` steps ``n_layers`` decoder layers, drawn at random, are trained; the others are
frozen until the next draw. The parameters outside the layers (embeddings, final norm, head)
train at every step.

The draw for the steps ``k*interval .. (k+1)*interval - 1`` is Axolotl's LISA callback's:
``np.random.seed(k*interval); np.random.choice(range(num_layers), n_layers, replace=False)``
(the seed is the step the draw happens at), so it is the same on every device and layout and
after a resume. A frozen layer is what an ``AdamW`` with ``requires_grad=False`` makes of it: no
gradient (it is left out of the clipping norm), no update, no weight decay, its moments and its
step count (Adam's bias correction) untouched; so each layer keeps its own count, as
``torch.optim.AdamW`` keeps one per parameter.

Pure and compilable: the draws are a table fixed when the optimizer is built (``total_steps``),
read at the state's step count; the state's moments mirror the parameters (ZeRO and checkpoints
shard them as Adam's).

Mechanism: Optimizer update (LISA: sampled layers trained, each with its own step count).
"""
from __future__ import annotations

import math
import re
from typing import Any, NamedTuple, Optional

import numpy as np
import optree
import torch

from functional_pp.core.tree import leaves_with_paths
from functional_pp.optim.base import (FRESH, GradientTransformation, PyTree, check_number, new_count, transform,
                                      tree_flatten, tree_leaves, tree_unflatten)
from functional_pp.optim.clipping import global_norm
from functional_pp.optim.masking import Mask, add_decayed_weights, resolve_mask

__all__ = ["LayerSamplingState", "sample_layers", "lisa_draws", "layer_of_path"]


class LayerSamplingState(NamedTuple):
    """State of :func:`sample_layers`: ``count`` (0-dim int64, the updates so far),
    ``layer_counts`` (int64 ``[num_layers + 1]``: each layer's updates, the last entry the
    always-trained rest's) and ``moments``, the inner transformation's state, whose param-like
    fields mirror the parameters."""

    count: torch.Tensor
    layer_counts: torch.Tensor
    moments: Any
    param_like_fields = ()   # class attribute (the moments declare their own)


def lisa_draws(num_layers: int, n_layers: int, interval: int, total_steps: int) -> torch.Tensor:
    """``[draws, num_layers]`` bools: row ``k`` the layers trained at steps ``k*interval`` to
    ``(k+1)*interval - 1`` (Axolotl's draw, seeded by the step it happens at)."""
    rows = []
    for k in range(max(1, math.ceil(total_steps / interval))):
        chosen = np.random.RandomState(k * interval).choice(range(num_layers), n_layers, replace=False)
        row = torch.zeros(num_layers, dtype=torch.bool)
        row[torch.as_tensor(chosen)] = True
        rows.append(row)
    return torch.stack(rows)


def layer_of_path(path: str, layers_key: str = "layers") -> Optional[int]:
    """The decoder layer a parameter path belongs to (``layers.3.mlp.up_proj`` -> 3), or None."""
    found = re.match(rf"(?:.*\.)?{re.escape(layers_key)}\.(\d+)(?:\.|$)", path)
    return int(found.group(1)) if found else None


def sample_layers(moments: GradientTransformation, *, n_layers: int, interval: int, total_steps: int,
                  weight_decay: float = 0.0, mask: Mask = None, clip_norm: Optional[float] = None,
                  layers_key: str = "layers") -> GradientTransformation:
    """LISA around ``moments`` (``scale_by_adam`` or a low-bit one: a state with ``count`` and
    param-like moments): gradients of frozen layers dropped, ``clip_norm`` over the trained ones,
    ``moments`` then ``weight_decay`` (on ``mask``) per layer with the layer's own count, frozen
    layers' updates zero. Chain it with ``scale_by_learning_rate`` (:func:`optim.adamw`'s
    parts). ``layers_key``: the parameter tree's list of decoder layers."""
    n_layers = int(check_number("sample_layers", "n_layers", n_layers, low=1, hint=" (layers trained at once)"))
    interval = int(check_number("sample_layers", "interval", interval, low=1, hint=" (steps between draws)"))
    if total_steps is None or int(total_steps) < 1:
        raise ValueError(f"sample_layers: total_steps={total_steps!r}: the draws are fixed when the optimizer is "
                         f"built, so give the number of steps (max_steps)")
    total_steps = int(total_steps)
    if clip_norm is not None:
        clip_norm = check_number("sample_layers", "max_norm", clip_norm, low=0.0, low_open=True)
    draws: dict[int, torch.Tensor] = {}

    def groups(params: PyTree) -> tuple[list[int], int]:
        """Per leaf its layer (``num_layers`` for the rest), and the number of layers."""
        layer = [layer_of_path(p, layers_key) for p, _ in leaves_with_paths(params)]
        num = max((i for i in layer if i is not None), default=-1) + 1
        if num == 0:
            raise ValueError(f"LISA: the model has no parameters under {layers_key!r}.N (its decoder layers)")
        if n_layers > num:
            raise ValueError(f"LISA: n_layers={n_layers} but the model has {num} layers: give at most {num} "
                             f"(lisa_n_layers)")
        if num not in draws:
            draws[num] = lisa_draws(num, n_layers, interval, total_steps)
        return [num if i is None else i for i in layer], num

    def init(params: PyTree) -> LayerSamplingState:
        _, num = groups(params)
        count = new_count(params)
        return LayerSamplingState(count, torch.zeros(num + 1, dtype=torch.int64, device=count.device),
                                  moments.init(params))

    def update(updates: PyTree, state: LayerSamplingState, params: PyTree = None, *,
               norm_reducer: Any = None, **extra: Any):
        if params is None:
            raise ValueError("sample_layers needs the parameters: call update(updates, state, params)")
        layer, num = groups(params)
        table = draws[num].to(state.count.device)
        row = torch.clamp(torch.div(state.count, interval, rounding_mode="floor"), max=table.shape[0] - 1)
        active = torch.cat([table[row], torch.ones(1, dtype=torch.bool, device=table.device)])   # [num + 1]
        g_leaves, spec = tree_flatten(updates)
        p_leaves = tree_leaves(params)
        on = [active[layer[i]] for i in range(len(g_leaves))]
        grads = [torch.where(a, g, torch.zeros((), dtype=g.dtype, device=g.device)) for a, g in zip(on, g_leaves)]
        if clip_norm is not None:
            norm = global_norm(tree_unflatten(spec, grads), norm_reducer)
            coef = torch.clamp(clip_norm / (norm + 1e-6), max=1.0)
            grads = [g * coef.to(g.dtype) for g in grads]
        flags = resolve_mask(mask, params)
        decay = list(optree.tree_leaves(flags)) if flags is not None else [True] * len(grads)
        fields = type(state.moments).param_like_fields
        param_spec = optree.tree_structure(updates, none_is_leaf=False)
        parts = {f: param_spec.flatten_up_to(getattr(state.moments, f)) for f in fields}
        new_parts = {f: list(v) for f, v in parts.items()}
        out, counts = list(grads), list(state.layer_counts.unbind(0))
        for g in range(num + 1):
            idx = [i for i in range(len(grads)) if layer[i] == g]
            if not idx:
                continue
            sub_state = state.moments._replace(count=state.layer_counts[g],
                                               **{f: [parts[f][i] for i in idx] for f in fields})
            sub_params = [p_leaves[i] for i in idx]
            upd, new_sub = moments.update([grads[i] for i in idx], sub_state, sub_params)
            upd, _ = add_decayed_weights(weight_decay, [decay[i] for i in idx]).update(upd, None, sub_params)
            a = active[g]
            for k, i in enumerate(idx):
                out[i] = torch.where(a, upd[k], torch.zeros((), dtype=upd[k].dtype, device=upd[k].device))
                for f in fields:
                    new_parts[f][i] = optree.tree_map(lambda new, old: torch.where(a, new, old),
                                                      getattr(new_sub, f)[k], parts[f][i], none_is_leaf=False)
            counts[g] = torch.where(a, new_sub.count, state.layer_counts[g])
        moments_state = state.moments._replace(count=state.moments.count + 1,
                                               **{f: optree.tree_unflatten(param_spec, new_parts[f]) for f in fields})
        return (tree_unflatten(spec, out),
                LayerSamplingState(state.count + 1, torch.stack(counts), moments_state))

    return transform(init, update, FRESH)
