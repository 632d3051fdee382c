"""Elementwise ops on named arrays, broadcasting by name."""
from __future__ import annotations

import torch

from functional_pp.ops.einsum import _cache
from functional_pp.parallel.fsdp.regather import regather_scope, relayout
from functional_pp.parallel.fsdp.role import is_gathered
from functional_pp.parallel.named import Named, make_named, env, op_env, pvary, settle, varying_after


@_cache(1024)
def _align_plan(have: tuple[str, ...], dims: tuple[str, ...]) -> tuple:
    """How :func:`_align` moves dimensions ``have`` to ``dims``: the permutation (None: keep)
    and, per dimension of ``dims``, the source dimension or -1 for a new size-1 one (None:
    ``have`` permuted are the trailing dimensions of ``dims``, which torch broadcasts as is)."""
    order = [have.index(d) for d in dims if d in have]
    kept = [d for d in dims if d in have]
    where = [kept.index(d) if d in have else -1 for d in dims]
    trailing = tuple(kept) == dims[len(dims) - len(kept):]
    return (order if order != sorted(order) else None), (None if trailing else where)


def _align(x: Named, dims: tuple[str, ...], plan: tuple | None = None) -> torch.Tensor:
    """x's block with its dimensions permuted to the order of ``dims`` and size-1 dims added
    (none when x's dimensions, permuted, are the trailing ones of ``dims``: torch broadcasts);
    ``plan``: :func:`_align_plan` of them, when the caller has it."""
    order, where = plan if plan is not None else _align_plan(x._dims, dims)
    data = x._data.permute(order) if order is not None else x._data
    if where is None:
        return data
    return data.reshape([data.shape[i] if i >= 0 else 1 for i in where])


def broadcast_binary(fn, a, b, name: str, keep_partial: bool = False) -> Named:
    """Apply ``fn`` to two named arrays (or a named array and a number/0-d tensor)."""
    if not isinstance(a, Named) or not isinstance(b, Named):
        x, other, left = (a, b, True) if isinstance(a, Named) else (b, a, False)
        if isinstance(other, torch.Tensor) and other.ndim > 0:
            raise TypeError(f"{name}: cannot combine a named array with an unnamed tensor of shape "
                            f"{tuple(other.shape)}; wrap it with functional_pp.named(tensor, 'dims')")
        x = x if keep_partial else settle(x)
        data = fn(x._data, other) if left else fn(other, x._data)
        return make_named(data, x._dims, x._split, x._vary, x._partial, x._sizes)
    mesh, rules, plans = op_env()
    plan = None
    if plans is not None and a._sizes is not None and b._sizes is not None:   # eager: memoised
        key = ("binary", a._dims, a._sizes, b._dims, b._sizes)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _binary_layout(a, b, name, mesh, rules)
    dims, ta, tb, out_split, out_sizes, align_a, align_b = plan or _binary_layout(a, b, name, mesh, rules)
    if (a._split == ta and b._split == tb and a._vary == b._vary and not a._partial and not b._partial
            and not is_gathered(a.role) and not is_gathered(b.role)):
        # already laid out and typed alike: nothing to reconcile (docs/eager_overhead.md)
        data = fn(a._data if align_a is None else _align(a, dims, align_a),
                  b._data if align_b is None else _align(b, dims, align_b))
        return make_named(data, dims, out_split, a._vary, sizes=out_sizes)
    a, b = settle(a, ta), settle(b, tb)
    after = [varying_after(a, ta), varying_after(b, tb)]
    union = after[0] | after[1]
    a = relayout(pvary(a, union - after[0]), ta, name)
    b = relayout(pvary(b, union - after[1]), tb, name)
    with regather_scope([a, b]):
        data = fn(a._data if align_a is None else _align(a, dims, align_a),
                  b._data if align_b is None else _align(b, dims, align_b))
    return make_named(data, dims, out_split, frozenset(union), sizes=out_sizes)


def _binary_layout(a: Named, b: Named, name: str, mesh, rules) -> tuple:
    """The dimensions of ``a op b`` (a's, then b's others), the operands' target layouts, the
    result's layout and global sizes, and how each operand is aligned to the result
    (:func:`_align_plan`, None: its block as is); derived once per operand dims and sizes and
    kept beside the rules when eager (:func:`broadcast_binary`, docs/named_value.md)."""
    dims = a._dims + tuple(d for d in b._dims if d not in a._dims)
    sa, sb = a.shape, b.shape
    for d in set(a._dims) & set(b._dims):
        if sa[d] != sb[d]:
            raise ValueError(f"{name}: dimension {d!r} has size {sa[d]} and {sb[d]}")
    sizes = {**sb, **sa}
    target = dict(zip(dims, rules.resolve(dims, [sizes[d] for d in dims], mesh, name=f"{name} output")))
    aligns = [_align_plan(x._dims, dims) for x in (a, b)]
    return (dims, tuple(target[d] for d in a._dims), tuple(target[d] for d in b._dims),
            tuple(target[d] for d in dims), tuple(sizes[d] for d in dims),
            *[None if align == (None, None) else align for align in aligns])


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


def broadcast(fn, operands: list, name: str) -> Named:
    """Apply ``fn`` to the blocks of several named arrays (numbers pass through), broadcast by
    name to the union of their dimensions and laid out by the rules."""
    named_ops = [x for x in operands if isinstance(x, Named)]
    if not named_ops:
        raise TypeError(f"{name}: needs at least one named array")
    for x in operands:
        if isinstance(x, torch.Tensor) and x.ndim > 0:
            raise TypeError(f"{name}: cannot combine a named array with an unnamed tensor of shape "
                            f"{tuple(x.shape)}; wrap it with functional_pp.named(tensor, 'dims')")
    dims: tuple[str, ...] = ()
    sizes: dict[str, int] = {}
    for x in named_ops:
        for d, n in x.shape.items():
            if sizes.setdefault(d, n) != n:
                raise ValueError(f"{name}: dimension {d!r} has size {sizes[d]} and {n}")
        dims += tuple(d for d in x._dims if d not in dims)
    mesh, rules = env()
    target = dict(zip(dims, rules.resolve(dims, [sizes[d] for d in dims], mesh, name=f"{name} output")))
    ts = [tuple(target[d] for d in x._dims) for x in named_ops]
    named_ops = [settle(x, t) for x, t in zip(named_ops, ts)]
    after = [varying_after(x, t) for x, t in zip(named_ops, ts)]
    union = set().union(*after)
    ready = iter([relayout(pvary(x, union - a), t, name) for x, a, t in zip(named_ops, after, ts)])
    operands = [next(ready) if isinstance(x, Named) else x for x in operands]
    with regather_scope([x for x in operands if isinstance(x, Named)]):
        data = fn(*[_align(x, dims) if isinstance(x, Named) else x for x in operands])
    return make_named(data, dims, tuple(target[d] for d in dims), frozenset(union), sizes=tuple(sizes[d] for d in dims))


def where(cond: Named, a, b) -> Named:
    """``a`` where ``cond`` is true, else ``b`` (named arrays or numbers, broadcast by name)."""
    def fn(m, x, y):
        ref = x if isinstance(x, torch.Tensor) else y
        x = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=ref.dtype)
        y = y if isinstance(y, torch.Tensor) else torch.as_tensor(y, dtype=ref.dtype)
        return torch.where(m.bool(), x, y)
    if not isinstance(a, Named) and not isinstance(b, Named):
        raise TypeError("where: a or b must be a named array")
    return broadcast(fn, [cond, a, b], "where")


def _unary(fn, name: str):
    """The named op applying torch's elementwise ``fn`` to the block (no communication)."""
    def op(x: Named) -> Named:
        return x.map(fn)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Elementwise ``{name}`` of a named array (same dims and layout)."
    return op


silu = _unary(torch.nn.functional.silu, "silu")
relu = _unary(torch.relu, "relu")
exp = _unary(torch.exp, "exp")
log = _unary(torch.log, "log")
tanh = _unary(torch.tanh, "tanh")
rsqrt = _unary(torch.rsqrt, "rsqrt")
square = _unary(torch.square, "square")
cos = _unary(torch.cos, "cos")
sin = _unary(torch.sin, "sin")


def gelu(x: Named, approximate: str = "none") -> Named:
    """GELU; ``approximate="tanh"`` is GPT-2's tanh approximation."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return x.map(lambda t: torch.nn.functional.gelu(t, approximate=approximate))


def xielu(x: Named, alpha_p: Named, alpha_n: Named, beta: float = 0.5, eps: float = -1e-6) -> Named:
    """xIELU (Huang et al. 2024, Apertus' MLP activation) with its two trainable scalars:
    ``a_p x^2 + beta x`` where ``x > 0``, else ``a_n (expm1(min(x, eps)) - x) + beta x``, with
    ``a_p = softplus(alpha_p)`` and ``a_n = beta + softplus(alpha_n)`` (transformers'
    ``XIELUActivation``). ``alpha_p`` / ``alpha_n`` are named arrays without dimensions; under
    a layout splitting ``x`` their gradients are summed over the devices like any replicated
    parameter's."""
    def fn(t: torch.Tensor, ap: torch.Tensor, an: torch.Tensor) -> torch.Tensor:
        ap = torch.nn.functional.softplus(ap)
        an = beta + torch.nn.functional.softplus(an)
        return torch.where(t > 0, ap * t * t + beta * t, (torch.expm1(torch.clamp(t, max=eps)) - t) * an + beta * t)
    return broadcast(fn, [x, alpha_p, alpha_n], "xielu")


def _attach_operators(cls: type) -> None:
    """Give the named value type its arithmetic operators. They live here, in the ops layer
    that defines them, so that ``named`` does not import upwards (docs/architecture.md)."""
    # (name, torch function, op name, reflected, whether a pending sum is kept with a number:
    # as add/sub/mul/div above, inlined to spare a frame per operator)
    for name, fn, op, reflected, keep in (("add", torch.add, "add", False, False), ("radd", torch.add, "add", True, False),
                                          ("sub", torch.sub, "sub", False, False), ("rsub", torch.sub, "sub", True, False),
                                          ("mul", torch.mul, "mul", False, True), ("rmul", torch.mul, "mul", True, True),
                                          ("truediv", torch.div, "div", False, True),
                                          ("rtruediv", torch.div, "div", True, False)):
        def operator(self, other, fn=fn, op=op, reflected=reflected, keep=keep):
            keep = keep and not isinstance(other, Named)
            return broadcast_binary(fn, other, self, op, keep) if reflected else broadcast_binary(fn, self, other, op, keep)
        operator.__name__ = operator.__qualname__ = f"__{name}__"
        setattr(cls, f"__{name}__", operator)


_attach_operators(Named)
