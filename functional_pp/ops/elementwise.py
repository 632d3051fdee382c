"""Elementwise ops on named arrays, broadcasting by name."""
from __future__ import annotations

import torch

from ..named import Named, env, pvary, relayout, settle, varying_after
from .regather import regather_scope


def _align(x: Named, dims: tuple[str, ...]) -> torch.Tensor:
    """x's block with its dimensions permuted to the order of ``dims`` and size-1 dims added."""
    order = [x.dims.index(d) for d in dims if d in x.dims]
    data = x.data.permute(order) if order != sorted(order) else x.data
    shape, it = [], iter(data.shape)
    for d in dims:
        shape.append(next(it) if d in x.dims else 1)
    return data.reshape(shape)


def broadcast_binary(fn, a, b, name: str, keep_partial: bool = False) -> Named:
    """Apply ``fn`` to two named arrays (or a named array and a number/0-d tensor)."""
    if not isinstance(a, Named) or not isinstance(b, Named):
        x, other, left = (a, b, True) if isinstance(a, Named) else (b, a, False)
        if isinstance(other, torch.Tensor) and other.ndim > 0:
            raise TypeError(f"{name}: cannot combine a named array with an unnamed tensor of shape "
                            f"{tuple(other.shape)}; wrap it with functional_pp.named(tensor, 'dims')")
        x = x if keep_partial else settle(x)
        data = fn(x.data, other) if left else fn(other, x.data)
        return Named(data, x.dims, x.split, x.vary, x.partial)
    dims = a.dims + tuple(d for d in b.dims if d not in a.dims)
    sa, sb = a.shape, b.shape
    for d in set(a.dims) & set(b.dims):
        if sa[d] != sb[d]:
            raise ValueError(f"{name}: dimension {d!r} has size {sa[d]} and {sb[d]}")
    sizes = {**sb, **sa}
    mesh, rules = env()
    target = dict(zip(dims, rules.resolve(dims, [sizes[d] for d in dims], mesh, name=f"{name} output")))
    ta = tuple(target[d] for d in a.dims)
    tb = tuple(target[d] for d in b.dims)
    a, b = settle(a, ta), settle(b, tb)
    after = [varying_after(a, ta), varying_after(b, tb)]
    union = after[0] | after[1]
    a = relayout(pvary(a, union - after[0]), ta, name)
    b = relayout(pvary(b, union - after[1]), tb, name)
    with regather_scope([a, b]):
        data = fn(_align(a, dims), _align(b, dims))
    return Named(data, dims, tuple(target[d] for d in dims), union)


def add(a, b) -> Named:
    return broadcast_binary(torch.add, a, b, "add")


def sub(a, b) -> Named:
    return broadcast_binary(torch.sub, a, b, "sub")


def mul(a, b) -> Named:
    scalar = not (isinstance(a, Named) and isinstance(b, Named))
    return broadcast_binary(torch.mul, a, b, "mul", keep_partial=scalar)


def div(a, b) -> Named:
    keep = isinstance(a, Named) and not isinstance(b, Named)
    return broadcast_binary(torch.div, a, b, "div", keep_partial=keep)


def where(cond: Named, a: Named, b) -> Named:
    return broadcast_binary(lambda m, x: torch.where(m.bool(), x, torch.as_tensor(b, dtype=x.dtype)), cond, a, "where")


def silu(x: Named) -> Named:
    return x.map(torch.nn.functional.silu)


def gelu(x: Named) -> Named:
    return x.map(torch.nn.functional.gelu)


def relu(x: Named) -> Named:
    return x.map(torch.relu)


def exp(x: Named) -> Named:
    return x.map(torch.exp)


def log(x: Named) -> Named:
    return x.map(torch.log)


def tanh(x: Named) -> Named:
    return x.map(torch.tanh)


def rsqrt(x: Named) -> Named:
    return x.map(torch.rsqrt)


def square(x: Named) -> Named:
    return x.map(torch.square)


def _attach_operators(cls: type) -> None:
    """Give the named value type its arithmetic operators. They live here, in the ops layer
    that defines them, so that ``named`` does not import upwards (docs/architecture.md)."""
    for name, fn, reflected in (("add", add, False), ("radd", add, True), ("sub", sub, False),
                                ("rsub", sub, True), ("mul", mul, False), ("rmul", mul, True),
                                ("truediv", div, False), ("rtruediv", div, True)):
        def operator(self, other, fn=fn, reflected=reflected):
            return fn(other, self) if reflected else fn(self, other)
        operator.__name__ = operator.__qualname__ = f"__{name}__"
        setattr(cls, f"__{name}__", operator)


_attach_operators(Named)
