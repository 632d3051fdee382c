"""The compiled step traced natively: dynamo sees one opaque call, and AOT autograd traces
the step by running its Python on fake tensors (docs/compile.md, "Tracing time").

Dynamo interprets Python bytecode one instruction at a time; the step's bookkeeping over
named values (layouts, einsum plans, pytrees) made that interpretation most of the compile
time, growing with depth. Run natively, the same Python costs what eager costs on fake
tensors. What dynamo did besides tracing is done here:

* its guards: the step's function depends on its arguments (dynamo still guards their
  shapes, dtypes and structure) and on settings outside them, which the caller names in
  ``key`` (:class:`NativeStep`); another key is another compilation. A trace that read the
  device's rank (``DeviceContext.rank``) is that device's: the caller then keys by rank too,
  so simulated devices that share a process get a graph each (one graph for all of them
  otherwise);
* its replay of side effects: the token-id checks the step defers (ops/token_ids.py) are
  returned with its outputs and handed to the caller's list on every call.

Anything else the step writes outside its outputs happens once, while it is traced.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import optree
import torch

from functional_pp._torch import opaque_to_dynamo, register_pytree_constant, traced_natively
from functional_pp.compile.recompute import reset_region_ids
from functional_pp.core.runtime import counting_rank_reads, current_context
from functional_pp.ops.token_ids import defer_collected, deferred_checks


def dynamo_traces_step() -> bool:
    """``FPP_STEP_TRACE=dynamo``: dynamo interprets the step's Python as it did before native
    tracing (for comparing the two, benchmarks/compile_depth.py)."""
    return os.environ.get("FPP_STEP_TRACE") == "dynamo"


@register_pytree_constant
class NativeStep:
    """A step function, the structure of its arguments (``in_spec``, with their non-tensor
    leaves) and the settings its trace reads beyond them (``settings``, hashable): equal
    objects share a compilation. Built on the host by :func:`native_step`."""

    def __init__(self, fn: Callable[..., Any], settings: Any, in_spec: Any, in_statics: tuple):
        self.fn, self.settings, self.in_spec, self.in_statics = fn, settings, in_spec, in_statics
        self.key = (settings, in_spec, in_statics)
        self.out_skeleton: Any = None       # the outputs with each tensor replaced by _SLOT
        self.read_rank: int | None = None   # the device's rank, where the trace read it

    def __eq__(self, other: object) -> bool:
        return type(other) is NativeStep and other.fn == self.fn and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def native_step(fn: Callable[..., Any], settings: Any, args: tuple) -> NativeStep:
    """The :class:`NativeStep` of ``fn`` called with ``args`` under ``settings`` (a new one;
    keep them by ``.key`` to reuse compilations)."""
    leaves, spec = optree.tree_flatten(args, none_is_leaf=True)
    statics = tuple(_SLOT if isinstance(x, torch.Tensor) else x for x in leaves)
    try:
        hash(statics)
    except TypeError as e:
        raise TypeError(f"a compiled step's arguments hold a value that is neither a tensor nor hashable "
                        f"({e}); pass tensors, Python scalars or containers of them") from None
    return NativeStep(fn, settings, spec, statics)


def run_compiled(compiled: Callable[..., list], step: NativeStep, args: tuple) -> Any:
    """``step.fn(*args)`` through ``compiled`` (``torch.compile`` of :func:`call_natively`):
    the tensors of ``args`` go in, the outputs are rebuilt here, on the host, and the token-id
    checks the step deferred join the caller's list."""
    tensors = [x for x in optree.tree_leaves(args, none_is_leaf=True) if isinstance(x, torch.Tensor)]
    try:
        flat = compiled(step, *tensors)      # (the first call traces: then out_skeleton is known)
    except Exception as exc:                 # a refusal the trace wrapped: raised as it was written
        refusal = _refusal_in(exc)
        if refusal is None:
            raise
        raise ValueError(str(refusal)) from None
    out, checks = _refill(step.out_skeleton, iter(flat))
    defer_collected(checks)
    return out


def _refusal_in(exc: BaseException) -> ValueError | None:
    """The ValueError (the model's refusal of an input or an option, naming it) that the
    compiler's own exception wraps in its chain, if any; None for ``exc`` itself one."""
    seen, inner = set(), exc.__cause__ or exc.__context__
    while inner is not None and id(inner) not in seen:
        if type(inner) is ValueError:
            return inner
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    return None


def call_natively(step: NativeStep, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """What ``torch.compile`` compiles: one opaque call of ``step.fn``, traced natively; the
    tensors of its outputs, flat (:func:`run_compiled` rebuilds them)."""
    return _traced(step, *tensors)


@opaque_to_dynamo
def _traced(step: NativeStep, *tensors: torch.Tensor) -> list[torch.Tensor]:
    it = iter(tensors)
    args = optree.tree_unflatten(step.in_spec, [next(it) if x is _SLOT else x for x in step.in_statics])
    reset_region_ids()               # every trace of the step numbers its regions alike
    with traced_natively(), deferred_checks() as checks, counting_rank_reads() as reads:
        out = step.fn(*args)
    if reads[0]:                     # the graph is this device's: others need their own
        step.read_rank = current_context().rank
    flat: list[torch.Tensor] = []
    step.out_skeleton = _skeleton((out, checks), flat)
    return flat


class _Slot:
    """Where a tensor goes back."""

    def __repr__(self) -> str:
        return "<tensor>"


_SLOT = _Slot()


def _skeleton(tree: Any, tensors: list) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return _SLOT
    kind = type(tree)
    if kind is dict:
        return {k: _skeleton(v, tensors) for k, v in tree.items()}
    if kind is list or kind is tuple:
        return kind(_skeleton(v, tensors) for v in tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):       # a named tuple
        return kind(*[_skeleton(v, tensors) for v in tree])
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(f"a natively traced step returns {kind.__name__}: return tensors, Python scalars "
                    f"or dicts, lists and tuples of them")


def _refill(tree: Any, tensors) -> Any:
    if tree is _SLOT:
        return next(tensors)
    kind = type(tree)
    if kind is dict:
        return {k: _refill(v, tensors) for k, v in tree.items()}
    if kind is list or kind is tuple:
        return kind(_refill(v, tensors) for v in tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return kind(*[_refill(v, tensors) for v in tree])
    return tree
