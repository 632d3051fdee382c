"""shard_map: run a function on this device's blocks of its inputs, by partition specs.

Specs are mesh-axis partition specs (``P("dp_shard", None, "tp")``) or logical dimension
names (``"batch seq hidden"``) resolved by the active :class:`Rules`. Each device passes the
global inputs; the function sees its local blocks; outputs are reassembled into global
values by their out_specs.

Inside, every tensor has JAX's varying type (``shard_map(check_vma=True)``,
functional_pp/parallel/vma.py, docs/manual_mode.md): an input varies over the axes its
in_spec splits it over and is invariant over the others; ops and collectives cast invariant
operands to varying where they need it; an output must be invariant over every axis its
out_spec replicates it over (or it is refused) and is cast to varying over the axes its
out_spec splits it over.
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from functional_pp.core.layout import Layout, P, Rules, spec_to_layout
from functional_pp.core.runtime import (active_rules, current_context, current_policy,  # noqa: F401 (re-exported)
                                        use_rules)
from functional_pp.parallel import vma as V
from functional_pp.parallel.collectives import all_gather, split_invariant


def _is_spec(s) -> bool:
    return s is None or isinstance(s, (P, str))


def _layout(spec, x: torch.Tensor, shape, mesh, rules, name) -> Layout:
    if spec is None:
        return ((),) * x.ndim
    if isinstance(spec, str):
        dims = spec.split()
        if len(dims) != x.ndim:
            raise ValueError(f"{name}: spec {spec!r} names {len(dims)} dimensions but the tensor has "
                             f"{x.ndim} (shape {tuple(x.shape)})")
        return (rules or active_rules()).resolve(dims, shape, mesh, name=name)
    return spec_to_layout(spec, x.ndim, mesh, name=name, shape=shape)


def _flatten_with_specs(tree, specs, what: str):
    """Pair every tensor leaf of ``tree`` with its spec (a spec may cover a whole subtree)."""
    spec_leaves, spec_def = optree.tree_flatten(specs, is_leaf=_is_spec, none_is_leaf=True)
    try:
        subtrees = spec_def.flatten_up_to(tree)
    except ValueError as e:
        raise ValueError(f"shard_map: the structure of {what} does not match its specs: {e}") from None
    pairs = []
    for i, (spec, sub) in enumerate(zip(spec_leaves, subtrees)):
        paths, leaves, _ = optree.tree_flatten_with_path(sub, none_is_leaf=False)
        for p, leaf in zip(paths, leaves):
            pairs.append((f"{what}[{i}]" + "".join(f"[{k!r}]" for k in p), spec, leaf))
    return pairs, spec_def, subtrees


def shard_map(f: Callable, in_specs: Any, out_specs: Any, *, rules: Rules | None = None,
              check_rep: bool | None = None, check_vma: bool = True) -> Callable:
    """Wrap ``f`` to run on local blocks: ``shard_map(f, in_specs=(P("dp"), None), out_specs=P())``.

    ``check_vma=True`` (the default, as JAX's): every tensor of ``f`` knows the mesh axes it
    varies over, invariant operands are cast to varying where an op needs it (``psum`` of a
    replicated input sums its copies, as in JAX), and an output varying over an axis its
    out_spec replicates is an error. ``check_vma=False``: untyped, every cast is the caller's
    (:func:`functional_pp.pvary`), as before this check existed.

    ``check_rep=True`` checks at run time that every output declared replicated over a mesh
    axis is equal on all its devices (values that are typed invariant but are not: Python
    numbers read from tensors, random draws); None: as the ambient policy's ``check_rep`` says
    when the function runs (``with functional_pp.configure(check_rep=True):``, docs/policy.md)."""
    if _is_spec(in_specs) or not isinstance(in_specs, tuple):
        in_specs = (in_specs,)

    def wrapped(*args):
        ctx = current_context()
        mesh = ctx.mesh
        check = current_policy().check_rep if check_rep is None else check_rep
        if len(args) != len(in_specs):
            raise ValueError(f"shard_map: got {len(args)} arguments but {len(in_specs)} in_specs")
        local_args, typed_inputs = [], []
        for i, (arg, spec) in enumerate(zip(args, in_specs)):
            pairs, _, _ = _flatten_with_specs((arg,), (spec,), f"argument {i}")
            mapping = {}
            for name, s, x in pairs:
                if not isinstance(x, torch.Tensor):
                    continue
                layout = _layout(s, x, tuple(x.shape), mesh, rules, name)
                for dim, axes in enumerate(layout):
                    if axes:
                        x = split_invariant(x, axes, dim)
                mapping[name] = x
                shown = f"argument {i}" + name[len(f"argument {i}[0]"):]       # (the path inside the argument)
                typed_inputs.append((x, {a for axes in layout for a in axes}, shown))
            local_args.append(optree.tree_unflatten(
                optree.tree_structure(arg, none_is_leaf=False),
                [mapping.get(n, leaf) for (n, _, _), leaf in zip(pairs, optree.tree_leaves(arg, none_is_leaf=False))]))
        with V.typed_body(mesh, check_vma) as state:
            if state is not None:
                for x, axes, name in typed_inputs:
                    state.set(x, axes, name)
            out = f(*local_args)
            single = not isinstance(out_specs, tuple) or isinstance(out_specs, P)
            outs, specs = ((out,), (out_specs,)) if single else (out, out_specs)
            pairs, _, _ = _flatten_with_specs(outs, specs, "output")
            results = {}
            for name, s, y in pairs:
                if not isinstance(y, torch.Tensor):
                    continue
                layout = _layout(s, y, None, mesh, rules, name)
                if state is not None:
                    _check_vma(state, y, layout, name, s)
                if check:
                    _check_replicated(y, layout, name)
                for dim, axes in enumerate(layout):
                    if axes:      # (typed: an invariant output is cast to varying first, as JAX does)
                        y = all_gather(y, axes, axis=dim, tiled=True, invariant=True)
                results[name] = y
        leaves = optree.tree_leaves(outs, none_is_leaf=False)
        rebuilt = optree.tree_unflatten(optree.tree_structure(outs, none_is_leaf=False),
                                        [results.get(n, leaf) for (n, _, _), leaf in zip(pairs, leaves)])
        return rebuilt[0] if single else rebuilt

    wrapped.__wrapped__ = f
    return wrapped


def _check_vma(state: V.State, y: torch.Tensor, layout: Layout, name: str, spec) -> None:
    """An output may not vary over an axis its out_spec replicates it over (JAX's check)."""
    used = {a for axes in layout for a in axes}
    for axis in state.ordered(state.vma(y) - used):
        raise ValueError(
            f"shard_map: {name} is declared replicated over mesh axis {axis!r} (out_specs {spec!r}) but "
            f"varies over it: {V.describe(y, state.origin(y))}. Reduce it over {axis!r} (psum, pmean, "
            f"pmax), or split it over {axis!r} in out_specs, or, where every device holds the same "
            f"value by construction, pass check_vma=False (and check_rep=True to check it).")


def _check_replicated(y: torch.Tensor, layout: Layout, name: str) -> None:
    ctx = current_context()
    mesh = ctx.mesh
    used = {a for axes in layout for a in axes}
    for axis in mesh.axis_names:
        if axis in used or mesh.shape[axis] == 1:
            continue
        group = mesh.group(ctx.rank, axis)
        values = ctx.backend.exchange_objects(y.detach().cpu(), group)
        ref = values[0]
        for i, v in enumerate(values[1:], 1):
            if v.shape != ref.shape or not torch.equal(v, ref):
                diff = (v.double() - ref.double()).abs().max().item() if v.shape == ref.shape else "shape"
                raise ValueError(
                    f"shard_map: {name} is declared replicated over mesh axis {axis!r} but differs "
                    f"between {axis} index 0 and {i} (max abs difference {diff}); split it in "
                    f"out_specs or reduce it (psum/pmean) over {axis!r}.")
