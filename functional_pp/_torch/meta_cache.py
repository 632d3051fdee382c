"""Memoised meta kernels: an ATen op on ``meta`` tensors gives output *metadata* only (shape,
strides, dtype), a function of its inputs' metadata and its other arguments. Many meta kernels
are Python (torch's refs and decompositions), and a dry-run calls the same few hundred ops
with the same shapes thousands of times (layers, micro-steps, candidate layouts), so
:func:`call_meta` keeps each result's metadata and answers a repeat with fresh
``empty_strided`` tensors (docs/planning.md, "Speed").

Only ops whose result cannot depend on anything else are memoised, and only results that a
fresh ``empty_strided`` reproduces exactly: an ATen/prims overload that mutates nothing,
returns no alias of an input, has no data-dependent output shape, with every tensor argument
a plain ``meta`` tensor, every other argument a hashable constant, and every result a fresh
contiguous-storage ``meta`` tensor (offset 0, storage of exactly the bytes its strides reach,
shared with no input and no other result).

In-place and ``out=`` ops (a mutable schema, e.g. the optimizer's ``_foreach_addcmul_`` or a
loss's ``logsumexp.out``, whose meta kernels are Python) write no data on ``meta``: their only
effects are a check of the arguments and, possibly, a resize. One that left every argument's
metadata as it was and returned nothing or some of its tensor arguments is answered on a repeat
with those same arguments, without the kernel (the repeat's metadata is the first call's, so
its check passes again). Ops that change metadata in place (``inplace_view``) never are.
Anything else runs the kernel as before."""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import _len_torch_dispatch_stack

_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SKIP_TAGS = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view}
MAX_ENTRIES = 50_000

_results: dict = {}                 # key -> tuple of (shape, stride, dtype) or a single one
_cacheable: dict = {}               # op overload -> bool
_lock = threading.Lock()
_state = threading.local()
stats = {"hits": 0, "misses": 0, "uncached": 0}    # misses: results remembered


@contextlib.contextmanager
def disabled():
    """Run every meta kernel (e.g. to check that memoised results equal the kernels')."""
    before = getattr(_state, "off", False)
    _state.off = True
    try:
        yield
    finally:
        _state.off = before


def clear() -> None:
    """Forget every memoised result."""
    with _lock:
        _results.clear()


def call_meta(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)``, from memory when the same op met the same metadata before.
    Called from a dispatch mode's ``__torch_dispatch__`` (that mode is off the stack there);
    another mode beneath it would see ``empty_strided`` instead of ``func``, so then nothing
    is memoised."""
    if getattr(_state, "off", False) or not _is_cacheable(func) or _len_torch_dispatch_stack() > 0:
        stats["uncached"] += 1
        return func(*args, **kwargs)
    parts: list = [func]
    inputs: list = []
    if not (_key(args, parts, inputs) and _key(kwargs, parts, inputs)):
        stats["uncached"] += 1
        return func(*args, **kwargs)
    key = tuple(parts)
    spec = _results.get(key)
    if spec is not None:
        stats["hits"] += 1
        return _build(spec, inputs)
    mutable = func._schema.is_mutable
    before = _state(inputs) if mutable else None
    out = func(*args, **kwargs)
    spec = _mutated(out, inputs, before) if mutable else _spec(out, {_storage(t) for t in inputs})
    stats["misses" if spec is not None else "uncached"] += 1
    if spec is not None:
        with _lock:
            if len(_results) >= MAX_ENTRIES:
                _results.clear()
            _results[key] = spec
    return out


def _is_cacheable(func) -> bool:
    known = _cacheable.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = (isinstance(func, torch._ops.OpOverload) and func.namespace in ("aten", "prims")
                 and schema is not None and not _SKIP_TAGS.intersection(func.tags)
                 and (schema.is_mutable or all(r.alias_info is None for r in schema.returns)))
        _cacheable[func] = known
    return known


_PLAIN_TYPES = frozenset(_PLAIN)
_CONSTANT_TYPES = frozenset(_CONSTANTS)


def _key(value, parts: list, inputs: list) -> bool:
    """Append ``value``'s metadata to ``parts`` (its tensors to ``inputs``); False where it
    cannot be a key. ``value``: an op's positional arguments (a tuple) or keyword arguments."""
    if isinstance(value, dict):
        parts.append((dict, tuple(value)))
        return _key_items(value.values(), parts, inputs)
    return _key_items(value, parts, inputs)


def _key_items(items, parts: list, inputs: list) -> bool:
    strided = torch.strided
    for v in items:
        t = type(v)
        if t in _PLAIN_TYPES:
            if not v.is_meta or v.layout != strided:
                return False
            parts.append((tuple(v.shape), v.stride(), v.storage_offset(), v.dtype))
            inputs.append(v)
        elif t in _CONSTANT_TYPES:
            parts.append((t, v))
        elif isinstance(v, (tuple, list)):
            if all(type(x) is int for x in v):           # a shape: the common case, kept whole
                parts.append((t, tuple(v)))
            else:
                parts.append((t, len(v)))
                if not _key_items(v, parts, inputs):
                    return False
        elif isinstance(v, dict):
            parts.append((dict, tuple(v)))
            if not _key_items(v.values(), parts, inputs):
                return False
        elif isinstance(v, _CONSTANTS) and not isinstance(v, torch.Tensor):
            parts.append((t, v))
        else:
            return False
    return True


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _spec(out, input_storages: set):
    """The metadata that rebuilds ``out``, or None where ``empty_strided`` would not be exact."""
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else out
    if not isinstance(outs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in outs):
        return None
    specs, seen = [], set(input_storages)
    for t in outs:
        if (type(t) is not torch.Tensor or not t.is_meta or t.layout != torch.strided or t.storage_offset() != 0
                or t.requires_grad):
            return None
        s = _storage(t)
        if s in seen:
            return None
        seen.add(s)
        spec = (tuple(t.shape), t.stride(), t.dtype)
        if _empty(spec).untyped_storage().nbytes() != t.untyped_storage().nbytes():
            return None
        specs.append(spec)
    return specs[0] if single else (type(outs), tuple(specs))


_ARG = "arg"          # a mutating op's result: ("arg", positions of its tensor arguments returned)


def _state(inputs: list) -> list:
    """What a mutating op may change of its tensor arguments: metadata and storage."""
    return [(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, _storage(t)) for t in inputs]


def _mutated(out, inputs: list, before: list):
    """A mutating op's result as positions among ``inputs``, or None where a repeat could differ:
    an argument's metadata or storage changed (a resize, ``set_``), or a result is not one of
    its arguments."""
    if _state(inputs) != before:
        return None
    if out is None:
        return (_ARG, None)
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else out
    if not isinstance(outs, (tuple, list)):
        return None
    where = []
    for t in outs:
        i = next((i for i, x in enumerate(inputs) if x is t), None)
        if i is None:
            return None
        where.append(i)
    return (_ARG, where[0] if single else (type(outs), tuple(where)))


def _empty(spec) -> torch.Tensor:
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _build(spec, inputs: list):
    if spec[0] is _ARG:
        where = spec[1]
        if where is None or isinstance(where, int):
            return None if where is None else inputs[where]
        kind, positions = where
        return kind(inputs[i] for i in positions)
    if isinstance(spec[0], type):
        kind, specs = spec
        return kind(_empty(s) for s in specs)
    return _empty(spec)
