"""Specs say how each leaf of a saved tree is laid out, and skeletons record tree structure.

A spec tree mirrors (a prefix of) the saved tree. Its leaves are

- a Param-like object (``fpp.param(...)``, :class:`Spec`: anything with ``.shape`` and
  ``.dims``): the leaf is sharded by the rules along those named dims (global ``shape``);
- ``None``: the leaf (or the whole subtree) is replicated and written once, by rank 0;
- :data:`PER_RANK`: every rank holds its own value (e.g. a per-device RNG state) and writes it.

Paths are dotted strings (``"params.layers.0.w"``, ``"opt.mu.layers.0.w"``): dict keys, list
indices and namedtuple field names. A skeleton is the JSON description of a saved tree's
containers, so a loaded tree has the saved structure even where no spec describes it.
"""
from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from functional_pp.checkpoint.format import CheckpointError

PathT = tuple  # components: str | int


@dataclass(frozen=True)
class Spec:
    """A Param-like description of a tensor leaf: global shape, dimension names (``dims``;
    docs/names.md), and optionally the dtype it must have on load (``None``: whatever was
    saved)."""

    shape: tuple[int, ...]
    dims: tuple[str, ...]
    dtype: torch.dtype | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        dims = tuple(self.dims.split()) if isinstance(self.dims, str) else tuple(self.dims)
        object.__setattr__(self, "dims", dims)
        if len(self.shape) != len(self.dims):
            raise ValueError(f"Spec of shape {self.shape} needs one dimension name per dimension, "
                             f"got {self.dims}")

    @property
    def axes(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`dims` (docs/names.md)."""
        warnings.warn("Spec.axes is deprecated: use Spec.dims (dimension names; docs/names.md)",
                      DeprecationWarning, stacklevel=2)
        return self.dims


class _PerRank:
    def __repr__(self) -> str:
        return "PER_RANK"


PER_RANK = _PerRank()
"""Spec marker: every rank saves its own value of this leaf/subtree and loads its own back."""


def is_param_like(x: Any) -> bool:
    return (not isinstance(x, (torch.Tensor, dict, list, tuple, str, bytes))
            and hasattr(x, "shape") and hasattr(x, "dims"))


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def specs_like(decls: Any, dtype: torch.dtype | None = None) -> Any:
    """Specs for a tree that mirrors ``decls`` (optimizer moments): same shapes and axes,
    dtype ``dtype`` (``None``: accept any saved dtype)."""
    if is_param_like(decls):
        return Spec(tuple(decls.shape), tuple(decls.dims), dtype)
    if isinstance(decls, dict):
        return {k: specs_like(v, dtype) for k, v in decls.items()}
    if is_namedtuple(decls):
        return type(decls)(*(specs_like(v, dtype) for v in decls))
    if isinstance(decls, (list, tuple)):
        return type(decls)(specs_like(v, dtype) for v in decls)
    return decls


def _specs_like_state(decls: Any, state: Any, dtype: torch.dtype | None) -> Any:
    """:func:`specs_like` for a param-like field of a state: where the state holds, in place of
    a parameter's tensor, an object with ``param_specs(decl)`` (8-bit moments: codes and
    scales), that object gives the specs of its tensors."""
    if is_param_like(decls):
        own = getattr(state, "param_specs", None)
        return own(decls) if callable(own) else Spec(tuple(decls.shape), tuple(decls.dims), dtype)
    if isinstance(decls, dict) and isinstance(state, dict):
        return {k: _specs_like_state(v, state.get(k), dtype) for k, v in decls.items()}
    if isinstance(decls, (list, tuple)) and isinstance(state, (list, tuple)) and len(decls) == len(state):
        children = [_specs_like_state(d, s, dtype) for d, s in zip(decls, state)]
        return type(decls)(*children) if is_namedtuple(decls) else type(decls)(children)
    return specs_like(decls, dtype)


def state_specs(state: Any, decls: Any, dtype: torch.dtype | None = None) -> Any:
    """Specs for an optimizer state: fields a namedtuple lists in ``param_like_fields`` (Adam's
    ``mu``/``nu``, momentum ``trace``) mirror ``decls`` and are sharded like the params (a
    quantized moment in a parameter's place gives its own specs: ``param_specs``); every other
    leaf (step counts) gets ``None`` (replicated)."""
    if is_namedtuple(state):
        like = getattr(type(state), "param_like_fields", ())
        return type(state)(*(_specs_like_state(decls, v, dtype) if f in like else state_specs(v, decls, dtype)
                             for f, v in zip(type(state)._fields, state)))
    if isinstance(state, dict):
        return {k: state_specs(v, decls, dtype) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(state_specs(v, decls, dtype) for v in state)
    return None


def path_str(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def _children(node: Any) -> list[tuple[Any, Any]]:
    """``[(key, child)]`` of a container node."""
    if isinstance(node, dict):
        return list(node.items())
    if is_namedtuple(node):
        return list(zip(type(node)._fields, node))
    return list(enumerate(node))


def _kind(node: Any) -> str:
    if node is None:
        return "empty"
    if isinstance(node, dict):
        return "dict"
    if is_namedtuple(node):
        return f"namedtuple {type(node).__name__}"
    if isinstance(node, list):
        return "list"
    if isinstance(node, tuple):
        return "tuple"
    if isinstance(node, torch.Tensor):
        return "tensor"
    if is_param_like(node):
        return "Param"
    return type(node).__name__


_VALUE_TYPES = (bool, int, float, str)


@dataclass
class SaveLeaf:
    """One tensor of a tree being saved, with its spec (Param-like, None or PER_RANK)."""

    path: str
    value: torch.Tensor
    spec: Any


def flatten_for_save(tree: Any, specs: Any) -> tuple[list[SaveLeaf], Any]:
    """Walk ``tree`` with ``specs`` (a prefix tree): the tensor leaves with their specs and the
    JSON skeleton of ``tree`` (python scalars and strings are stored in it)."""
    leaves: list[SaveLeaf] = []

    def walk(node: Any, spec: Any, path: tuple) -> Any:
        where = path_str(path) or "<root>"
        inherited = spec is None or spec is PER_RANK
        if node is None:
            return None
        if isinstance(node, torch.Tensor):
            if not (inherited or is_param_like(spec)):
                raise CheckpointError(f"{where}: the value is a tensor but its spec is a "
                                      f"{_kind(spec)}; give a Param-like spec, None or PER_RANK")
            leaves.append(SaveLeaf(path_str(path), node, spec))
            return {"t": "tensor"}
        if isinstance(node, _VALUE_TYPES):
            if not inherited:
                raise CheckpointError(f"{where}: a python {type(node).__name__} cannot be sharded "
                                      f"(its spec is a {_kind(spec)}); use None as its spec")
            return {"t": "value", "v": node}
        if not isinstance(node, (dict, list, tuple)):
            raise CheckpointError(
                f"{where}: cannot save a {type(node).__name__}; checkpoints hold trees of "
                f"dicts/lists/tuples/namedtuples with torch.Tensor, bool, int, float or str leaves "
                f"(convert numpy arrays with torch.from_numpy)")
        if not inherited:
            if is_param_like(spec):
                raise CheckpointError(f"{where}: the spec is a Param but the value is a "
                                      f"{_kind(node)}")
            if _kind(spec) != _kind(node) and not (isinstance(spec, tuple)
                                                   and isinstance(node, tuple)):
                raise CheckpointError(f"{where}: the value is a {_kind(node)} but its spec is a "
                                      f"{_kind(spec)}")
        items = _children(node)
        keys = [k for k, _ in items]
        if inherited:
            sub_specs = [spec] * len(items)
        elif isinstance(node, dict):
            missing = [k for k in keys if k not in spec]
            extra = [k for k in spec if k not in node]
            if missing or extra:
                raise CheckpointError(
                    f"{where}: the specs do not mirror the tree"
                    + (f"; no spec for {[path_str(path + (k,)) for k in missing]}" if missing else "")
                    + (f"; specs for absent {[path_str(path + (k,)) for k in extra]}" if extra else ""))
            sub_specs = [spec[k] for k in keys]
        else:
            if len(spec) != len(node):
                raise CheckpointError(f"{where}: the value has {len(node)} entries but its spec "
                                      f"has {len(spec)}")
            sub_specs = list(spec)
        children = []
        for (k, child), sub_spec in zip(items, sub_specs):
            if isinstance(node, dict) and (not isinstance(k, (str, int)) or isinstance(k, bool)):
                raise CheckpointError(f"{where}: dict key {k!r} is not a str or int")
            children.append(walk(child, sub_spec, path + (k,)))
        if isinstance(node, dict):
            return {"t": "dict", "k": [k for k, _ in items], "c": children}
        if is_namedtuple(node):
            return {"t": "namedtuple", "name": type(node).__name__,
                    "k": list(type(node)._fields), "c": children}
        return {"t": "list" if isinstance(node, list) else "tuple", "c": children}

    if not isinstance(tree, dict):
        raise CheckpointError(f"the saved tree must be a dict of named entries (e.g. "
                              f"{{'params': ..., 'opt': ...}}), got a {_kind(tree)}")
    if specs is not None and not isinstance(specs, dict):
        raise CheckpointError(f"specs must be a dict like the tree (or None), got {_kind(specs)}")
    specs = dict(specs or {})
    extra = [k for k in specs if k not in tree]
    if extra:
        raise CheckpointError(f"specs name entries that the tree lacks: {extra}")
    skeleton = {"t": "dict", "k": list(tree), "c": []}
    for key, sub in tree.items():
        if not isinstance(key, str):
            raise CheckpointError(f"top-level keys must be strings, got {key!r}")
        skeleton["c"].append(walk(sub, specs.get(key), (key,)))
    seen: dict[str, int] = {}
    for leaf in leaves:
        seen[leaf.path] = seen.get(leaf.path, 0) + 1
    dup = [p for p, n in seen.items() if n > 1]
    if dup:
        raise CheckpointError(f"paths {dup} name more than one leaf (a dict key containing '.'?)")
    return leaves, skeleton


# --------------------------------------------------------------------------- loading
@dataclass
class LoadLeaf:
    """A tensor to read: its path, the index entry and the spec it is loaded with."""

    path: str
    entry: dict
    spec: Any  # Param-like (shard it) or None (whole tensor / own per-rank value)
    result: torch.Tensor | None = None


class _Slot:
    """Placeholder in a tree under construction, replaced by the loaded tensor."""

    def __init__(self, leaf: LoadLeaf):
        self.leaf = leaf


def _leaf_paths(skel: Any, path: tuple) -> list[str]:
    if skel is None:
        return []
    if skel["t"] == "tensor":
        return [path_str(path)]
    if skel["t"] == "value":
        return []
    keys = skel.get("k", range(len(skel["c"])))
    return [p for k, c in zip(keys, skel["c"]) for p in _leaf_paths(c, path + (k,))]


def _spec_paths(spec: Any, path: tuple) -> list[str]:
    if is_param_like(spec):
        return [path_str(path)]
    if isinstance(spec, (dict, list, tuple)):
        return [p for k, c in _children(spec) for p in _spec_paths(c, path + (k,))]
    return []


class LoadPlan:
    """Match a saved skeleton against load specs, collecting every mismatch at once."""

    def __init__(self, tensors: dict[str, dict]):
        self.tensors = tensors
        self.leaves: list[LoadLeaf] = []
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.problems: list[str] = []

    def build(self, skel: Any, spec: Any, path: tuple) -> Any:
        where = path_str(path)
        if spec is None or spec is PER_RANK:
            return self._from_skeleton(skel, path)
        if skel is None:
            self.missing += _spec_paths(spec, path)
            return None
        if is_param_like(spec):
            if skel["t"] != "tensor":
                self.problems.append(f"{where}: the model has a tensor here, the checkpoint a "
                                     f"{skel['t']}")
                return None
            entry = self.tensors.get(where)
            if entry is None:
                self.problems.append(f"{where}: in the structure but not in the tensor table")
                return None
            if tuple(entry["shape"]) != tuple(spec.shape):
                self.problems.append(f"{where}: shape mismatch: checkpoint {tuple(entry['shape'])}, "
                                     f"model {tuple(spec.shape)}")
            dtype = getattr(spec, "dtype", None)
            if dtype is not None and entry["dtype"] != str(dtype).removeprefix("torch."):
                self.problems.append(f"{where}: dtype mismatch: checkpoint {entry['dtype']}, "
                                     f"model {str(dtype).removeprefix('torch.')}")
            leaf = LoadLeaf(where, entry, spec)
            self.leaves.append(leaf)
            return _Slot(leaf)
        if not isinstance(spec, (dict, list, tuple)):
            raise CheckpointError(f"{where}: a spec leaf must be Param-like, None or PER_RANK, "
                                  f"got {_kind(spec)}")
        container = {"dict": "dict", "list": "list", "tuple": "tuple", "namedtuple": "tuple"}
        spec_is = "dict" if isinstance(spec, dict) else "list" if isinstance(spec, list) else "tuple"
        if skel["t"] in ("tensor", "value") or container[skel["t"]] != spec_is:
            self.problems.append(f"{where}: the model has a {_kind(spec)} here, the checkpoint a "
                                 f"{skel['t']}")
            return None
        out = []
        spec_items = _children(spec)
        if isinstance(spec, dict):
            saved = dict(zip(skel["k"], skel["c"]))
            for k, sub in spec_items:
                if k not in saved:
                    self.missing += _spec_paths(sub, path + (k,)) or [path_str(path + (k,))]
                    out.append(None)
                else:
                    out.append(self.build(saved[k], sub, path + (k,)))
            extra = [(k, sub) for k, sub in saved.items() if k not in spec]
        else:  # sequences match by position; paths use the saved names
            saved_keys = skel.get("k", list(range(len(skel["c"]))))
            for i, (k, sub) in enumerate(spec_items):
                if i >= len(skel["c"]):
                    self.missing += _spec_paths(sub, path + (k,)) or [path_str(path + (k,))]
                    out.append(None)
                else:
                    out.append(self.build(skel["c"][i], sub, path + (saved_keys[i],)))
            extra = list(zip(saved_keys, skel["c"]))[len(spec_items):]
        for k, sub in extra:
            self.unexpected += _leaf_paths(sub, path + (k,)) or [path_str(path + (k,))]
        if isinstance(spec, dict):
            return dict(zip(spec.keys(), out))
        if is_namedtuple(spec):
            return type(spec)(*out)
        return type(spec)(out)

    def _from_skeleton(self, skel: Any, path: tuple) -> Any:
        where = path_str(path)
        if skel is None:
            return None
        t = skel["t"]
        if t == "value":
            return skel["v"]
        if t == "tensor":
            entry = self.tensors.get(where)
            if entry is None:
                self.problems.append(f"{where}: in the structure but not in the tensor table")
                return None
            leaf = LoadLeaf(where, entry, None)
            self.leaves.append(leaf)
            return _Slot(leaf)
        keys = skel.get("k", list(range(len(skel["c"]))))
        children = [self._from_skeleton(c, path + (k,)) for k, c in zip(keys, skel["c"])]
        if t == "dict":
            return dict(zip(keys, children))
        if t == "list":
            return children
        if t == "namedtuple":
            cls = collections.namedtuple(skel["name"], keys)  # no import of saved classes
            return cls(*children)
        return tuple(children)


def fill(tree: Any) -> Any:
    """Replace every :class:`_Slot` of a tree built by :class:`LoadPlan` with its tensor."""
    if isinstance(tree, _Slot):
        return tree.leaf.result
    if isinstance(tree, dict):
        return {k: fill(v) for k, v in tree.items()}
    if is_namedtuple(tree):
        return type(tree)(*(fill(v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(fill(v) for v in tree)
    return tree
