"""Activation checkpointing for functions over named arrays: keep only the inputs and
recompute the function (its collectives included) in backward.

Two public hooks (docs/compile.md): :func:`remat` always recomputes a function;
:func:`layer` declares a model's repeated layer, recomputed when the training step asks for
it (``train_step(remat=True)``, or ``remat="selective"``: keep the results of matrix products
and attention, recompute the rest; :mod:`functional_pp.compile.selective`). Eagerly the
recomputation is ``torch.utils.checkpoint`` (selective: with torch's selective-checkpoint
contexts); under ``torch.compile`` the region is tagged and the compiled graph recomputes it
(:mod:`functional_pp.compile.recompute`).

A declared layer is the boundary where other mechanisms act; each decides for itself, through
the one call made to it here: a pipeline stage whether this call runs on this device
(``parallel/pipeline/stage.layer_call``), per-layer compilation which body runs
(``compile/layer_compile.CompiledLayer.active``), FSDP how the layer's weights are gathered
(``parallel/fsdp/units.as_unit``) and what a recomputed region keeps
(``parallel/fsdp/regather.recomputed_region``). This module reads only the step's ``remat``.

Mechanism: Activation checkpointing (`fpp.layer` and `fpp.remat`; eager).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import optree
from torch.utils.checkpoint import checkpoint, noop_context_fn

from functional_pp._torch import is_tracing
from functional_pp.compile.layer_compile import CompiledLayer
from functional_pp.compile.recompute import remat_region
from functional_pp.compile.selective import POLICIES, is_selective, selective_contexts
from functional_pp.core.observers import checkpointed
from functional_pp.parallel.fsdp.regather import recomputed_region
from functional_pp.parallel.fsdp.units import as_unit
from functional_pp.parallel.named import Named, current_policy
from functional_pp.parallel.pipeline.stage import layer_call


def _flatten(tree: Any):
    return optree.tree_flatten(tree, none_is_leaf=False)   # a Named is a leaf (docs/named_value.md)


def _meta(x: Named) -> tuple:
    return (x.dims, x.split, x.vary, x.partial)


def remat(fn: Callable[..., Named], out_like: int | None = None, *,
          selective: bool | str = False) -> Callable[..., Named]:
    """Wrap ``fn(*args) -> Named`` so that backward recomputes it instead of keeping its
    activations. Named arguments (anywhere in pytrees) keep their layouts.

    ``out_like=i`` declares that the result is laid out like positional argument ``i`` (a
    residual block); it is checked. ``selective=True`` keeps the results of matrix products
    and attention and recomputes only the other ops (:mod:`functional_pp.compile.selective`);
    ``selective="selective_alternate"`` recomputes every second matrix product too (torchtitan's)."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    selective = "selective" if selective is True else selective
    if selective is not False and selective not in POLICIES:
        raise ValueError(f"remat(selective={selective!r}): use True (every matmul's result kept) or one of "
                         f"{POLICIES} ('selective_alternate': every second matmul recomputed, torchtitan's op policy)")
    context_fn = functools.partial(selective_contexts, name, selective) if selective else noop_context_fn

    @functools.wraps(fn)
    def wrapped(*args):
        if is_tracing():
            with remat_region(selective):   # the compiled graph recomputes the region
                out = fn(*args)
            if out_like is not None and _meta(out) != _meta(args[out_like]):
                raise ValueError(f"remat(out_like={out_like}): the result is laid out as {_meta(out)} but "
                                 f"argument {out_like} as {_meta(args[out_like])}")
            return out
        leaves, spec = _flatten(args)
        slots = [i for i, x in enumerate(leaves) if isinstance(x, Named)]
        expected = _meta(args[out_like]) if out_like is not None else None
        found: dict = {}
        region = object()         # this call's region: its forward run and its recomputation

        def inner(*datas):
            rebuilt = list(leaves)
            for i, data in zip(slots, datas):
                x = leaves[i]
                rebuilt[i] = x.replace(data=data, tied=False, gathered_from=None)
            recompute = found.get("ran", False)
            found["ran"] = True
            with recomputed_region(), checkpointed(region, recompute):      # (FSDP keeps its gathers here)
                out = fn(*optree.tree_unflatten(spec, rebuilt))
            if expected is None:
                found["meta"] = _meta(out)
            elif _meta(out) != expected:
                raise ValueError(f"remat(out_like={out_like}): the result is laid out as {_meta(out)} but "
                                 f"argument {out_like} as {expected}")
            return out.data
        data = checkpoint(inner, *[leaves[i].data for i in slots], use_reentrant=False, context_fn=context_fn)
        dims, split, vary, partial = expected if expected is not None else found["meta"]
        return Named(data, dims, split, vary, partial)
    return wrapped


def layer(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare ``fn`` as one layer of a model (called once per layer, e.g.
    ``x = layer(p, x, ...)``). With ``train_step(remat=True)`` (or
    ``functional_pp.configure(remat=True)``) its activations are recomputed in backward,
    eagerly or compiled; with ``remat="selective"`` only those that are not results of matrix
    products or attention; otherwise it runs as is. Under ``train_step(compile="per_layer")``
    one compilation of ``fn`` runs every layer (:mod:`functional_pp.compile.layer_compile`)."""
    unit = as_unit(fn)                  # FSDP: the layer's weights as one unit (parallel/fsdp/units.py)
    recomputed = remat(unit)
    selective = {name: remat(unit, selective=name) for name in POLICIES}
    compiled = CompiledLayer(fn)

    def run(*args):
        mode = current_policy().remat
        body = compiled.active()        # per-layer compilation (compile/layer_compile.py), or None
        if body is not None:
            if is_selective(mode):
                raise NotImplementedError(
                    f"remat={mode!r} with compile='per_layer': a compiled layer runs as one kernel "
                    "sequence that eager selective checkpointing cannot split; use compile=True (the "
                    "whole step, docs/compile.md) or remat=True with per-layer compilation")
            return remat(body)(*args) if mode else body(*args)
        if is_selective(mode):
            return selective[mode](*args)
        return recomputed(*args) if mode else unit(*args)

    @functools.wraps(fn)
    def wrapped(*args):
        return layer_call(run, args)    # a pipeline stage decides which layers run (parallel/pipeline/stage.py)
    wrapped.__wrapped_layer__ = fn
    return wrapped
