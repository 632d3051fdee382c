"""Named einsum: contractions whose communication is derived from the operands' layouts."""
from __future__ import annotations

import torch

from ..named import Named, env, require_named, pvary, relayout, settle, varying_after
from .regather import regather_scope


def parse_pattern(pattern: str, n_operands: int) -> tuple[list[list[str]], list[str]]:
    if "->" not in pattern:
        raise ValueError(f"einsum pattern {pattern!r} needs '->' before the output dimensions")
    lhs, rhs = pattern.split("->")
    ins = [part.split() for part in lhs.split(",")]
    if len(ins) != n_operands:
        raise ValueError(f"einsum pattern {pattern!r} names {len(ins)} operands but got {n_operands}")
    return ins, rhs.split()


def global_sizes(operands, names_per_operand, what: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for i, (x, names) in enumerate(zip(operands, names_per_operand)):
        if not isinstance(x, Named):
            raise TypeError(f"{what}: operand {i} is a {type(x).__name__}, not a named array; wrap it "
                            f"with functional_pp.named(tensor, 'dim names')")
        if sorted(names) != sorted(x.dims):
            raise ValueError(f"{what}: operand {i} has dimensions {x.dims} but the pattern names "
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


def einsum(pattern: str, *operands: Named) -> Named:
    """``einsum("batch seq hidden, hidden mlp -> batch seq mlp", x, w)`` over named arrays.

    Split dimensions that must be whole are all-gathered, contracted dimensions split across
    mesh axes give a pending sum (completed by psum, or psum_scatter when the consumer wants
    that axis split: sequence parallelism), and invariant operands meeting varying ones are
    cast to varying (their gradient is summed over that axis)."""
    what = f"einsum {pattern!r}"
    ins, out = parse_pattern(pattern, len(operands))
    require_named(what, **{f"operand {i}": x for i, x in enumerate(operands)})
    operands = [settle(x) for x in operands]
    sizes = global_sizes(operands, ins, what)
    unknown = [d for d in out if d not in sizes]
    if unknown:
        raise ValueError(f"{what}: output dimension {unknown[0]!r} appears in no operand")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: output names a dimension twice")
    mesh, rules = env()
    t_out = rules.resolve(out, [sizes[d] for d in out], mesh, name=f"{what} output")
    contracted = [d for d in sizes if d not in out]
    a_c = {c: _common_prefix([x.split[x.dims.index(c)] for x in operands if c in x.dims]) for c in contracted}
    used = {a for axes in a_c.values() for a in axes}
    t_loc = []
    for axes in t_out:
        cut = next((i for i, a in enumerate(axes) if a in used), len(axes))
        t_loc.append(axes[:cut])
    t_loc_of = dict(zip(out, t_loc))
    targets = [tuple(t_loc_of[d] if d in t_loc_of else a_c[d] for d in x.dims) for x in operands]
    after = [varying_after(x, t) for x, t in zip(operands, targets)]
    union = set().union(*after)
    ready = [relayout(pvary(x, union - a), t, what) for x, a, t in zip(operands, after, targets)]
    letters = {d: chr(ord("a") + i) for i, d in enumerate(sizes)}
    spec = ",".join("".join(letters[d] for d in x.dims) for x in ready) + "->" + "".join(letters[d] for d in out)
    with regather_scope(ready):
        data = torch.einsum(spec, *[x.data for x in ready])
    return Named(data, out, tuple(t_loc), union, used)
