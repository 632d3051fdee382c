"""Varying manual axes: the type of every plain tensor inside :func:`functional_pp.shard_map`,
as JAX's ``shard_map(check_vma=True)`` (docs/semantics.md, "Manual mode"; docs/manual_mode.md).

Each tensor of the body carries the set of mesh axes it *varies* over (its "vma"): an input
varies over the axes its in_spec splits it over, a collective's result over what the
collective leaves varying, and every other torch op's result over the union of its tensor
operands'. An operand invariant over an axis that the op needs varying is cast with
:func:`functional_pp.pvary` first, so its gradient is summed over the axis (JAX's
``pvary`` / ``pcast(to="varying")`` inserted automatically):

* a torch op (``a * b``, ``torch.cat``, ``x @ w``) whose tensor operands differ: every operand
  is cast to the union (JAX's ``insert_pvary`` on every n-ary primitive);
* a collective over axes its operand is invariant over (``psum`` of a replicated value, an
  ``all_gather`` or ``ppermute`` of one): the operand is cast over those axes first;
* an output invariant over an axis its out_spec splits: cast before the blocks are joined.

The types live in a table of this device's :class:`State` (per thread: simulated devices are
threads), filled by a ``TorchFunctionMode`` that sees every torch function the body calls;
tensors the table does not know (constants, closed-over tensors, fresh ``torch.zeros``) are
invariant, as a closed-over constant is in JAX. Programs whose types cannot be made right by a
cast are refused, the message naming the value, the axis and the fix: an in-place op that
would make an invariant tensor varying, ``pvary`` of an already varying value, an output that
varies over an axis its out_spec replicates.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterable, Iterator

import optree
import torch
from torch.overrides import TorchFunctionMode

from functional_pp._torch import apply_function, in_backward, is_tracing
from functional_pp.core.runtime import per_thread
from functional_pp.parallel.transposes import _PVary

_EMPTY: frozenset = frozenset()
_local = per_thread("parallel.vma")

# in-place torch functions not named ``*_``: their first operand is written to
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                              "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                              "__ilshift__", "__irshift__", "__imatmul__"})


def _func_name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":                       # a property, e.g. Tensor.shape
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    return name


def _inplace(func, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    return (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))
            or kwargs.get("out") is not None)


def describe(t: torch.Tensor, origin: str | None) -> str:
    """A value for an error message: its dtype, shape and where it came from."""
    what = f"a {str(t.dtype).replace('torch.', '')} tensor of shape {tuple(t.shape)}"
    return f"{what} ({origin})" if origin else what


class State:
    """The varying types of one device's tensors while it runs a shard_map body."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.live = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)   # size-1 axes never vary
        self._live_set = frozenset(self.live)
        self._types: dict[int, tuple[weakref.ref, frozenset, object]] = {}
        self._sets = 0
        self.suspended = 0

    # ------------------------------------------------------------------ table
    def vma(self, t: torch.Tensor) -> frozenset:
        entry = self._types.get(id(t))
        if entry is None or entry[0]() is not t:
            return _EMPTY
        return entry[1]

    def origin(self, t: torch.Tensor) -> str | None:
        entry = self._types.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        origin = entry[2]
        return origin if origin is None or isinstance(origin, str) else f"the result of {_func_name(origin)}"

    def set(self, t: torch.Tensor, vma: Iterable[str], origin=None) -> torch.Tensor:
        """Record that ``t`` varies over ``vma`` (``origin``: what produced it, a name or the
        torch function, for messages)."""
        if not isinstance(vma, frozenset) or not vma <= self._live_set:
            vma = frozenset(a for a in vma if a in self._live_set)
        types = self._types
        if not vma and origin is None:
            types.pop(id(t), None)     # (an entry under this id is t's or a dead tensor's)
            return t
        types[id(t)] = (weakref.ref(t), vma, origin)
        self._sets += 1
        if self._sets % 4096 == 0:     # entries of dead tensors (ids may be reused: checked on read)
            for key in [k for k, e in types.items() if e[0]() is None]:
                del types[key]
        return t

    def ordered(self, axes: Iterable[str]) -> tuple[str, ...]:
        axes = set(axes)
        return tuple(a for a in self.mesh.axis_names if a in axes)

    # ------------------------------------------------------------------ casts
    def cast(self, t: torch.Tensor, axes: Iterable[str]) -> torch.Tensor:
        """``t`` varying over ``axes`` too: pvary over those it is invariant over. One cast per
        use, as JAX inserts them: each use's cotangent is summed on its own."""
        have = self.vma(t)
        missing = self.ordered(a for a in axes if a in self.live and a not in have)
        if not missing:
            return t
        with self.suspend():
            out = apply_function(_PVary, t, missing) if t.requires_grad else t.view_as(t)
        return self.set(out, have | set(missing), self.origin(t))

    @contextmanager
    def suspend(self) -> Iterator[None]:
        """Torch functions inside pass through untyped (the collectives' own bookkeeping)."""
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1


def current() -> State | None:
    """This device's typing state while it runs a shard_map body (None elsewhere: collectives
    called directly inside ``launch`` are untyped, the explicit style)."""
    stack = getattr(_local, "stack", None)
    if not stack:
        return None
    state = stack[-1]
    return None if state is None or state.suspended else state


def _tensors(args, kwargs) -> list | None:
    """The tensors among the arguments and one level of lists and tuples in them (None where
    they nest deeper)."""
    found = []
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        found.append(b)
                    elif isinstance(b, (list, tuple, dict)):
                        return None
            elif isinstance(a, dict):
                return None
    return found


class _Mode(TorchFunctionMode):
    """Types every torch function the body calls (see the module docstring)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        if st.suspended or in_backward():
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        if tensors is None:            # nested containers: the general walk
            tensors = [x for x in optree.tree_leaves((args, kwargs), none_is_leaf=True) if isinstance(x, torch.Tensor)]
        if not tensors:
            return func(*args, **kwargs)
        vmas = [st.vma(t) for t in tensors]
        union = vmas[0].union(*vmas[1:]) if len(vmas) > 1 else vmas[0]
        if union and any(v != union for v in vmas):
            leaves, treespec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
            idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
            vmas = [st.vma(leaves[i]) for i in idx]
            if _inplace(func, kwargs):
                target = kwargs.get("out")
                if not isinstance(target, torch.Tensor):
                    target = args[0] if args and isinstance(args[0], torch.Tensor) else leaves[idx[0]]
                lacking = st.ordered(union - st.vma(target))
                if lacking:
                    raise ValueError(
                        f"shard_map: in-place {_func_name(func)} writes a value varying over mesh axis "
                        f"{lacking[0]!r} into {describe(target, st.origin(target))}, which is invariant over "
                        f"it; an invariant tensor cannot become varying in place: cast it first, "
                        f"x = functional_pp.pvary(x, {lacking!r}), or use the out-of-place op")
            for i, v in zip(idx, vmas):
                if v != union:
                    leaves[i] = st.cast(leaves[i], union)
            args, kwargs = optree.tree_unflatten(treespec, leaves)
        out = func(*args, **kwargs)
        if union:
            if isinstance(out, torch.Tensor):
                st.set(out, union, func)
            else:
                for y in optree.tree_leaves(out, none_is_leaf=False):
                    if isinstance(y, torch.Tensor):
                        st.set(y, union, func)
        return out


@contextmanager
def typed_body(mesh, enabled: bool = True) -> Iterator[State | None]:
    """Type the tensors of a shard_map body run on this device (nothing with
    ``enabled=False``). Under torch.compile, whose tracer cannot keep the types' table, a typed
    body is refused rather than run untyped (that would change its gradients)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    if enabled and is_tracing():
        raise RuntimeError(
            "shard_map(check_vma=True) cannot be traced by torch.compile (its varying types live in "
            "an eager table): compile the function that runs inside the shard_map instead, or pass "
            "check_vma=False with every pvary written out (docs/manual_mode.md)")
    if any(s is not None for s in stack):
        raise RuntimeError(
            "shard_map inside the body of a shard_map with check_vma=True: the inner body's tensors would "
            "be typed by both; call the inner function directly, or pass check_vma=False to the outer one")
    if not enabled:
        stack.append(None)
        try:
            yield None
        finally:
            stack.pop()
        return
    state = State(mesh)
    stack.append(state)
    try:
        with _Mode(state):
            yield state
    finally:
        stack.pop()


# ------------------------------------------------------------ collectives' rules
def operand(x: torch.Tensor, axes: tuple[str, ...]) -> tuple[State | None, torch.Tensor]:
    """For a collective over ``axes`` (which takes varying operands, as JAX's): the state and
    ``x`` cast to varying over ``axes``."""
    st = current()
    if st is None:
        return None, x
    return st, st.cast(x, axes)


def result(st: State | None, y: torch.Tensor, vma: Iterable[str], origin: str) -> torch.Tensor:
    if st is not None:
        st.set(y, vma, origin)
    return y
