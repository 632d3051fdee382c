"""Renaming, splitting and merging named dimensions."""
from __future__ import annotations

import re
from typing import Mapping

from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.fsdp.role import of_view
from functional_pp.parallel.named import Named, make_named, env, op_env, require_named, settle, target_layout


def rename(x: Named, mapping: Mapping[str, str] | None = None, **kw: str) -> Named:
    """Rename dimensions (``rename(x, seq="res_seq")``) and move to the new names' layout:
    this is where sequence parallelism scatters or gathers the residual stream."""
    mapping = {**mapping, **kw} if mapping else kw
    if not isinstance(x, Named):
        require_named("rename", x=x)
    mesh, rules, plans = op_env()
    # eager: what a rename does is derived once per value type and kept with the rules' plans
    key = ("rename", x._dims, x._split, x._sizes, tuple(mapping.items()))
    memo = None if x._sizes is None else plans
    plan = None if memo is None else memo.get(key)
    if plan is None:
        plan = _rename_plan(x, mapping, rules)
        if memo is not None:
            memo[key] = plan
    dims, reorder, sizes, target = plan
    if reorder is None and not x._partial and x._split == target:   # a new name, nothing to move
        return make_named(x._data, dims, x._split, x._vary, x._partial, sizes, x.role)
    if reorder is not None:     # the two names order the dimension differently: gather it under the old one
        x = relayout(x, reorder, f"rename {mapping}")
    y = _keep_param(x, x.data, dims, x.split, x.partial, sizes)
    return y if not y.partial and y.split == target else relayout(y, target, f"rename {mapping}")


def _rename_plan(x: Named, mapping: dict, rules) -> tuple:
    """The new dimensions, the layout to gather a differently ordered dimension into (or None),
    the global sizes and the layout of the result."""
    for old in mapping:
        x._check_dim(old, "rename")
    dims = tuple(mapping.get(d, d) for d in x.dims)
    if len(set(dims)) != len(dims):
        raise ValueError(f"rename {mapping}: the result {dims} names a dimension twice")
    sizes = tuple(x.shape.values())
    reorder = [i for i, d in enumerate(x.dims)
               if rules.splits_balanced(d, x.split[i]) != rules.splits_balanced(dims[i], x.split[i])]
    layout = tuple(() if i in reorder else s for i, s in enumerate(x.split)) if reorder else None
    return dims, layout, sizes, target_layout(dims, sizes, name=f"rename {mapping}")


def _keep_param(x: Named, data, dims, split, partial=frozenset(), sizes=None) -> Named:
    """A value of ``data`` (a view of ``x``'s data under other names or shape), typed like
    ``x``, that stays a parameter if ``x`` is one: FSDP re-gathers it in backward instead of
    keeping it gathered (docs/layouts.md)."""
    return make_named(data, tuple(dims), tuple(split), x.vary, partial, sizes, of_view(x.role, data, x.data))


def _contiguous_split(x: Named, i: int, what: str) -> Named:
    """``x`` with dimension ``i`` whole if it is split in load-balanced order (a reshape of
    such a dimension would mix its chunks)."""
    _, rules = env()
    if rules.splits_balanced(x.dims[i], x.split[i]):
        x = relayout(x, tuple(() if j == i else s for j, s in enumerate(x.split)), what)
    return x


def split_dim(x: Named, dim: str, into: Mapping[str, int]) -> Named:
    """Split ``dim`` into new dimensions, e.g. ``split_dim(x, "qkv", {"heads": 8, "head_dim": 64})``;
    the mesh axes splitting ``dim`` go to the first new dimension."""
    x = settle(x)
    x._check_dim(dim, "split_dim")
    i = x.dims.index(dim)
    x = _contiguous_split(x, i, f"split_dim {dim}")
    names, sizes = list(into), list(into.values())
    total = 1
    for s in sizes:
        total *= s
    if total != x.size(dim):
        raise ValueError(f"split_dim: {dim!r} has size {x.size(dim)} but {dict(into)} multiplies to {total}")
    mesh, rules = env()
    k = mesh.axis_size(x.split[i]) if x.split[i] else 1
    if sizes[0] % k or (k > 1 and rules.splits_balanced(names[0], x.split[i])):
        x = relayout(x, tuple(() if j == i else s for j, s in enumerate(x.split)))
        k = 1
    local = [sizes[0] // k] + sizes[1:]
    shape = list(x.data.shape[:i]) + local + list(x.data.shape[i + 1:])
    dims = x.dims[:i] + tuple(names) + x.dims[i + 1:]
    split = x.split[:i] + (x.split[i],) + ((),) * (len(names) - 1) + x.split[i + 1:]
    sizes = x.shape
    sizes = [sizes[d] for d in x.dims[:i]] + list(into.values()) + [sizes[d] for d in x.dims[i + 1:]]
    y = _keep_param(x, x.data.reshape(shape), dims, split, sizes=tuple(sizes))
    return relayout(y, target_layout(dims, sizes, name=f"split_dim {dim}"))


def merge_dims(x: Named, dims: tuple[str, ...], into: str) -> Named:
    """Merge adjacent dimensions ``dims`` (in order) into one named ``into``."""
    x = settle(x)
    idx = [x.dims.index(x._check_dim(d, "merge_dims")) for d in dims]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        x = transpose(x, *[d for d in x.dims if d not in dims][:idx[0]], *dims,
                      *[d for d in x.dims if d not in dims][idx[0]:])
        idx = [x.dims.index(d) for d in dims]
    i = idx[0]
    # only the first merged dimension may stay split, and only in contiguous order
    _, rules = env()
    first = x.split[idx[0]]
    keep_first = not (rules.splits_balanced(x.dims[idx[0]], first) or rules.splits_balanced(into, first))
    need = tuple(s if j not in idx[1:] and (j != idx[0] or keep_first) else ()
                 for j, s in enumerate(x.split))
    x = relayout(x, need)
    n = 1
    for j in idx:
        n *= x.data.shape[j]
    shape = list(x.data.shape[:i]) + [n] + list(x.data.shape[idx[-1] + 1:])
    new_dims = x.dims[:i] + (into,) + x.dims[idx[-1] + 1:]
    split = x.split[:i] + (x.split[i],) + x.split[idx[-1] + 1:]
    y = _keep_param(x, x.data.reshape(shape), new_dims, split)
    return relayout(y, target_layout(new_dims, [y.shape[d] for d in new_dims], name=f"merge_dims {into}"))


def transpose(x: Named, *dims: str) -> Named:
    """Reorder the local dimensions (a no-op for the named semantics)."""
    if sorted(dims) != sorted(x.dims):
        raise ValueError(f"transpose: {dims} is not a permutation of {x.dims}")
    order = [x.dims.index(d) for d in dims]
    sizes = None if x._sizes is None else tuple(x._sizes[i] for i in order)
    return _keep_param(x, x.data.permute(order), dims, [x.split[i] for i in order], x.partial, sizes)


_GROUP = re.compile(r"\(([^)]*)\)|(\S+)")


def _parse_side(side: str) -> list[list[str]]:
    return [m.group(1).split() if m.group(1) is not None else [m.group(2)] for m in _GROUP.finditer(side)]


def rearrange(x: Named, pattern: str, **sizes: int) -> Named:
    """einops-style regrouping by name: ``rearrange(x, "b s (heads hd) -> b s heads hd", heads=8)``
    or the reverse; groups are named ``a*b`` after merging unless the output names them."""
    lhs, rhs = (_parse_side(s) for s in pattern.split("->"))
    for group in lhs:
        if len(group) > 1:
            merged = "*".join(group)
            total = x.size(merged) if merged in x.dims else None
            if merged not in x.dims:
                raise ValueError(f"rearrange: input has no dimension {merged!r} for group {group}")
            known = {g: sizes[g] for g in group if g in sizes}
            missing = [g for g in group if g not in known]
            if len(missing) > 1:
                raise ValueError(f"rearrange: give the sizes of {missing[1:]} for group {group}")
            prod = 1
            for v in known.values():
                prod *= v
            if missing:
                known[missing[0]] = total // prod
            x = split_dim(x, merged, {g: known[g] for g in group})
    flat = [d for g in rhs for d in g]
    x = transpose(x, *flat)
    for group in rhs:
        if len(group) > 1:
            x = merge_dims(x, tuple(group), "*".join(group))
    return x


def the_one_dim(op: str, role: str, candidates: tuple[str, ...] | list[str], hint: str) -> str:
    """The single dimension of ``candidates`` an op can take as its ``role`` when the caller did
    not name it; an error naming the keyword to pass when there is not exactly one."""
    if len(candidates) == 1:
        return candidates[0]
    found = "none" if not candidates else f"{len(candidates)}: {tuple(candidates)}"
    raise ValueError(f"{op}: cannot tell which dimension is {role} ({hint}; found {found}): name it, "
                     f"e.g. {op}(..., {role}='...')")
