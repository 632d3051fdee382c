"""Named einsum: contractions whose communication is derived from the operands' layouts."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from functional_pp._torch import is_tracing
from functional_pp.parallel.fsdp.regather import regather_scope, relayout
from functional_pp.parallel.fsdp.role import is_gathered
from functional_pp.parallel.named import Named, make_named, op_env, pvary, require_named, settle, varying_after


def _cache(maxsize: int):
    """``functools.lru_cache`` that torch.compile traces around quietly: dynamo ignores an
    lru_cache and warns at every cached call, so a compiling caller runs the plain function
    (once per graph: the trace is cached instead)."""
    def decorate(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args):
            return fn(*args) if is_tracing() else cached(*args)
        call.cache_info = cached.cache_info
        return call
    return decorate


def parse_pattern(pattern: str, n_operands: int) -> tuple[list[list[str]], list[str]]:
    """``("a b, b c -> a c", 2)`` -> ``([["a", "b"], ["b", "c"]], ["a", "c"])`` (fresh lists)."""
    ins, out = _parsed(pattern, n_operands)
    return [list(names) for names in ins], list(out)


@_cache(1024)
def _parsed(pattern: str, n_operands: int) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """The parse of a pattern, once per pattern (a model repeats a handful of them)."""
    if "->" not in pattern:
        raise ValueError(f"einsum pattern {pattern!r} needs '->' before the output dimensions")
    lhs, rhs = pattern.split("->")
    ins = tuple(tuple(part.split()) for part in lhs.split(","))
    if len(ins) != n_operands:
        raise ValueError(f"einsum pattern {pattern!r} names {len(ins)} operands but got {n_operands}")
    return ins, tuple(rhs.split())


def _matmul_depth(dims: tuple[tuple[str, ...], ...], out: tuple[str, ...]) -> int:
    """``k`` when the contraction is ``a @ b`` over the last ``k`` dimensions of ``a`` and the
    first ``k`` of ``b`` (in the same order) and the output is ``a``'s others then ``b``'s:
    then einsum is one ``torch.mm`` of two reshapes, the cheapest form eagerly. 0 otherwise."""
    if len(dims) != 2:
        return 0
    a, b = dims
    k = len(set(a) & set(b))
    if k == 0 or a[len(a) - k:] != b[:k] or out != a[:len(a) - k] + b[k:]:
        return 0
    return k


@_cache(4096)
def _torch_spec(dims_per_operand: tuple[tuple[str, ...], ...], out: tuple[str, ...]) -> str:
    """torch.einsum's one-letter equation for operands and output named by dimension names."""
    letters: dict[str, str] = {}
    for dims in dims_per_operand:
        for d in dims:
            letters.setdefault(d, chr(ord("a") + len(letters)))
    return (",".join("".join(letters[d] for d in dims) for dims in dims_per_operand) + "->"
            + "".join(letters[d] for d in out))


def global_sizes(operands, names_per_operand, what: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for i, (x, names) in enumerate(zip(operands, names_per_operand)):
        if not isinstance(x, Named):
            raise TypeError(f"{what}: operand {i} is a {type(x).__name__}, not a named array; wrap it "
                            f"with functional_pp.named(tensor, 'dim names')")
        if sorted(names) != sorted(x._dims):
            raise ValueError(f"{what}: operand {i} has dimensions {x._dims} but the pattern names "
                             f"{tuple(names)}")
        for d, n in x.shape.items():
            if sizes.setdefault(d, n) != n:
                raise ValueError(f"{what}: dimension {d!r} has size {sizes[d]} in one operand and {n} "
                                 f"in operand {i}")
    return sizes


def _common_prefix(splits: list[tuple[str, ...]]) -> tuple[str, ...]:
    if not splits:
        return ()
    k = 0
    while all(len(s) > k and s[k] == splits[0][k] for s in splits):
        k += 1
    return splits[0][:k]


Contract = Callable[[str, Sequence[Any], int], Named]
_OPERAND_TYPES: dict[type, Contract] = {}


def register_operand(cls: type, contract: Contract) -> None:
    """Operands of type ``cls`` (not named arrays: a quantized weight, ops/quantized.py; an
    adapted one, adapters/lora.py) compute the einsum they take part in themselves:
    ``contract(pattern, operands, i)``, ``i`` their position among the operands."""
    _OPERAND_TYPES[cls] = contract


def einsum(pattern: str, *operands: Named) -> Named:
    """``einsum("batch seq hidden, hidden mlp -> batch seq mlp", x, w)`` over named arrays.

    Split dimensions that must be whole are all-gathered, contracted dimensions split across
    mesh axes give a pending sum (completed by psum, or psum_scatter when the consumer wants
    that axis split: sequence parallelism), and invariant operands meeting varying ones are
    cast to varying (their gradient is summed over that axis). An operand of a type given to
    :func:`register_operand` computes the contraction itself (a quantized or adapted weight)."""
    for i, x in enumerate(operands):
        if not isinstance(x, Named):
            contract = _OPERAND_TYPES.get(type(x))
            if contract is not None:
                return contract(pattern, operands, i)
            require_named(f"einsum {pattern!r}", **{f"operand {i}": x for i, x in enumerate(operands)})
    operands = [settle(x) if x._partial else x for x in operands]
    mesh, rules, plans = op_env()
    targets, casts, t_loc, vary, used, out_sizes, spec, out_dims = _plan(pattern, operands, mesh, rules, plans)
    ready = [relayout(pvary(x, c), t, f"einsum {pattern!r}") if (c or t != x._split) else x
             for x, c, t in zip(operands, casts, targets)]
    gathered = False
    for x in ready:
        gathered = gathered or is_gathered(x.role)
    if gathered:        # a gathered weight: not saved for backward (parallel/fsdp/regather.py)
        with regather_scope(ready):
            data = _contract(spec, ready)
    else:
        data = _contract(spec, ready)
    return make_named(data, out_dims, t_loc, vary, used, out_sizes)


def _contract(spec, ready: list[Named]) -> torch.Tensor:
    """The local contraction: one matrix product when ``spec`` is a depth (docs/eager_overhead.md),
    else ``torch.einsum`` with the equation ``spec``."""
    if isinstance(spec, int):
        a, w = ready[0]._data, ready[1]._data
        lead, tail = a.shape[:a.ndim - spec], w.shape[spec:]
        if spec > 1:
            a = a.reshape(*lead, -1)
        if spec > 1 or w.ndim != 2:
            w = w.reshape(a.shape[-1], -1)
        data = torch.matmul(a, w)            # one mm of the folded leading dimensions
        return data.view(*lead, *tail) if len(tail) != 1 else data
    return torch.einsum(spec, *[x._data for x in ready])


def _plan(pattern: str, operands: list[Named], mesh, rules, plans: dict | None) -> tuple:
    """What einsum does with operands of these types, derived once per pattern and operand types
    and kept in the eager ``plans`` of the rules and mesh (:func:`functional_pp.parallel.named.op_env`):
    per operand its target layout and the axes it is cast to varying over; the output's
    layout, type and global sizes; torch's equation; the output's dimensions."""
    if plans is None:       # traced: nothing is kept
        return _derive_plan(pattern, operands, mesh, rules)
    if len(operands) == 2:     # (the common case without a generator's frames)
        a, b = operands
        key = ("einsum", pattern, a._dims, a._split, a._vary, a._sizes, b._dims, b._split, b._vary, b._sizes)
    else:
        key = ("einsum", pattern, tuple([(x._dims, x._split, x._vary, x._sizes) for x in operands]))
    plan = plans.get(key)
    if plan is None:
        plan = _derive_plan(pattern, operands, mesh, rules)
        if all(x._sizes is not None for x in operands):
            plans[key] = plan
    return plan


def _derive_plan(pattern: str, operands: list[Named], mesh, rules) -> tuple:
    ins, out = _parsed(pattern, len(operands))
    what = f"einsum {pattern!r}"
    sizes = global_sizes(operands, ins, what)
    unknown = [d for d in out if d not in sizes]
    if unknown:
        raise ValueError(f"{what}: output dimension {unknown[0]!r} appears in no operand")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: output names a dimension twice")
    out_sizes = tuple(sizes[d] for d in out)
    t_out = rules.resolve(out, out_sizes, mesh, name=f"{what} output")
    contracted = [d for d in sizes if d not in out]
    a_c = {c: _common_prefix([x._split[x._dims.index(c)] for x in operands if c in x._dims]) for c in contracted}
    used = {a for axes in a_c.values() for a in axes}
    t_loc = []
    for axes in t_out:
        cut = next((i for i, a in enumerate(axes) if a in used), len(axes))
        t_loc.append(axes[:cut])
    t_loc_of = dict(zip(out, t_loc))
    targets = [tuple(t_loc_of[d] if d in t_loc_of else a_c[d] for d in x._dims) for x in operands]
    after = [varying_after(x, t) for x, t in zip(operands, targets)]
    union = set().union(*after)
    casts = [frozenset(union - a) for a in after]
    spec = _matmul_depth(tuple(x._dims for x in operands), out) or _torch_spec(tuple(x._dims for x in operands), out)
    return (targets, casts, tuple(t_loc), frozenset(union | used), frozenset(used), out_sizes, spec, out)
