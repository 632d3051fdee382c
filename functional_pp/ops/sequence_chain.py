"""Recurrences along a sequence split over devices (context parallelism): one mechanism for every
layer that carries a state along the sequence (Mamba2's SSD scan, the gated delta rule, the causal
convolutions' last inputs).

An op writes its recurrence once as a step ``step(blocks, shared, state) -> (outputs, state)``: the
outputs of one contiguous block of the sequence given the state the block starts from, and the state
it ends in. :func:`along_sequence` runs it over the whole sequence: where the sequence is whole, one
step from the op's initial state; where it is split over a mesh axis, the blocks in sequence order,
each on the device that holds it, the state handed from the device holding one block to the device
holding the next (a load-balanced split, ``balanced("cp")``: device i holds blocks i and 2c-1-i of
2c, so the chain runs 0, 1, ..., c-1 over the devices, stays on device c-1, then back to device 0).
The backward is the same chain reversed (each block's gradient, then the state's gradient handed back
to the device of the block before), written as one autograd function so that every device issues
the same sends in the same order whatever it computes. A serial chain: the devices take turns.

The step runs on local blocks only and must not communicate: the op aligns its operands before (every
collective outside the chain) and gives the parameters the step reads as ``shared`` (their gradients
are summed over the blocks). Under remat (full or selective) each block is checkpointed by itself and
recomputed on its device in the chain's backward; each block's work is announced as serial
(``core/observers.serial_work``) so that the planner counts the other devices' turns."""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import optree
import torch

from torch.utils.checkpoint import checkpoint, noop_context_fn

from functional_pp._torch import is_tracing
from functional_pp._torch.selective_checkpoint import outside_selective_checkpoint
from functional_pp.compile.selective import is_selective, selective_contexts
from functional_pp.core.observers import serial_work
from functional_pp.core.runtime import use_rules
from functional_pp.devices import mesh_view
from functional_pp.parallel import collectives as C
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.named import Named, current_policy, env, make_named, settle

Step = Callable[[list, list, list], tuple]


def seq_axes(x: Named, seq: str) -> tuple[str, ...]:
    """The mesh axes splitting ``x``'s dimension ``seq``."""
    return x.split[x.dims.index(seq)]


def along_sequence(step: Step, inputs: Sequence[Named | None], state: Sequence, *, seq: str, op: str,
                   shared: Sequence[Named] = ()) -> tuple[Named, ...]:
    """``step`` run over the whole of dimension ``seq`` of ``inputs`` (named values with that dimension;
    None passes through), from ``state`` (named values or tensors, the state before the first position),
    handing the state from block to block; returns ``step``'s outputs (named values with ``seq``) for
    the whole sequence, laid out as the inputs' ``seq``."""
    inputs = [None if x is None else settle(x) for x in inputs]
    first = next(x for x in inputs if x is not None)
    axes = seq_axes(first, seq)
    if not axes:
        return tuple(step(inputs, list(shared), list(state))[0])
    if is_tracing():
        raise ValueError(f"{op}: a recurrence along a sequence split over {axes} (context parallelism) runs its "
                         f"blocks device after device, which torch.compile does not trace yet; run the step "
                         f"eagerly (compile off) or do not split {seq!r}")
    if len(axes) != 1:
        raise ValueError(f"{op}: the sequence {seq!r} is split over {axes}; a recurrence along it runs over one "
                         f"mesh axis (context parallelism: Rules(seq=balanced('cp'))); split {seq!r} over one axis")
    inputs = [x if x is None or seq_axes(x, seq) == axes else
              relayout(x, tuple(axes if d == seq else s for d, s in zip(x.dims, x.split)), op) for x in inputs]
    shared = [settle(p) for p in shared]
    return mesh_view.one_rank_or_every_device(
        lambda: _chain(step, inputs, list(shared), list(state), seq, axes, env()[1].splits_balanced(seq, axes)),
        lambda: _refuse_batched(op))


def _refuse_batched(op: str):
    raise ValueError(f"{op}: a recurrence along a sequence split over devices (context parallelism) runs its "
                     f"blocks device after device, which a batched simulation (every device at once) cannot; "
                     f"simulate with threads (launch's default) or use cp 1")


def block_order(n: int, balanced: bool) -> list[tuple[int, int]]:
    """(device, local block) of each block of a sequence split over ``n`` devices, in sequence order."""
    if not balanced:
        return [(i, 0) for i in range(n)]
    return [(j, 0) for j in range(n)] + [(2 * n - 1 - j, 1) for j in range(n, 2 * n)]


def _chain(step, inputs, shared, state, seq, axes, balanced):
    n, rank = C.axis_size(axes), C.axis_index(axes)
    order = block_order(n, balanced)
    parts = 2 if balanced else 1
    present = [x for x in inputs if x is not None]
    for x in present:
        if x.data.shape[x.dims.index(seq)] % parts:
            raise ValueError(f"the local sequence ({x.data.shape[x.dims.index(seq)]}) of a load-balanced split must "
                             f"be even")
    flat_state, state_tree = optree.tree_flatten(state, namespace="functional_pp")
    meta: dict = {}
    spec = _Spec(step, inputs, shared, state_tree, seq, axes, order, rank, parts, meta)
    outs = _Chain.apply(spec, *[x.data for x in present], *[p.data for p in shared], *flat_state)
    return tuple(make_named(o, dims, tuple(axes if d == seq else s for d, s in zip(dims, split)),
                            vary | frozenset(axes)) for o, (dims, split, vary) in zip(outs, meta["outs"]))


class _Spec:
    """What the chain's autograd function needs besides tensors."""

    def __init__(self, step, inputs, shared, state_tree, seq, axes, order, rank, parts, meta):
        self.step, self.inputs, self.shared, self.state_tree = step, inputs, shared, state_tree
        self.seq, self.axes, self.order, self.rank, self.parts, self.meta = seq, axes, order, rank, parts, meta
        self.devices = len(order) // parts      # (taking turns: a device's blocks wait for the others')

    def block(self, x: Named, data: torch.Tensor) -> Named:
        """``x``'s local block ``data`` as a value whose ``seq`` is whole (it varies over the chain's axis)."""
        split = tuple(() if d == self.seq else s for d, s in zip(x.dims, x.split))
        return make_named(data, x.dims, split, x.vary | frozenset(self.axes))

    def slot(self, x: Named, data: torch.Tensor, k: int) -> torch.Tensor:
        return data.chunk(self.parts, dim=x.dims.index(self.seq))[k]

    def send(self, tensors: list, src: int, dst: int) -> list:
        """``tensors`` of device ``src`` on device ``dst`` (None: nothing to send, a gradient of an integer)."""
        if src == dst:
            return tensors
        return [None if t is None else C.raw_permute(t.contiguous(), self.axes, ((src, dst),)) for t in tensors]

    def run(self, k: int, blocks: list, shared: list, state: list):
        """One step on local block ``k``: its outputs (tensors) and the state after it (flat tensors)."""
        named, it = [], iter(blocks)
        for x in self.inputs:
            named.append(None if x is None else self.block(x, next(it)))
        shared_named = [make_named(t, p.dims, p.split, p.vary, p.partial) for p, t in zip(self.shared, shared)]
        state_in = optree.tree_unflatten(self.state_tree, state)
        with use_rules(env()[1].replace(**{self.seq: ()})):      # (what the step makes of seq: whole, as its block)
            outs, state_out = self.step(named, shared_named, state_in)
        outs = [settle(o) for o in outs]
        self.meta["outs"] = [(o.dims, o.split, o.vary) for o in outs]
        self.meta["seq_at"] = [o.dims.index(self.seq) for o in outs]
        return [o.data for o in outs], optree.tree_leaves(state_out, namespace="functional_pp")


def _run_block(spec: _Spec, k: int, blocks: list, shared: list, state: list, remat) -> tuple[list, list]:
    """``spec.run`` of local block ``k``; under ``remat`` (True, "selective") checkpointed as a layer
    is: the block keeps its inputs (selective: and its matrix products' results) and its backward
    recomputes the rest. The step does not communicate, so the recomputation is the device's own."""
    if not remat:
        return spec.run(k, blocks, shared, state)
    n_out = []

    def flat(*tensors):
        o, new = spec.run(k, list(tensors[:len(blocks)]), list(tensors[len(blocks):len(blocks) + len(shared)]),
                          list(tensors[len(blocks) + len(shared):]))
        n_out[:] = [len(o)]
        return (*o, *new)
    out = checkpoint(flat, *blocks, *shared, *state, use_reentrant=False,
                     context_fn=functools.partial(selective_contexts, None, remat) if is_selective(remat)
                     else noop_context_fn)
    return list(out[:n_out[0]]), list(out[n_out[0]:])


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A fresh leaf of ``t``'s values, requiring grad where it can (floating point)."""
    return t.detach().requires_grad_(t.is_floating_point())


def _same_tensor(t: torch.Tensor) -> torch.Tensor:
    return t


def _zero_if_none(g, like: torch.Tensor):
    return g if g is not None or not like.is_floating_point() else torch.zeros_like(like)


class _Chain(torch.autograd.Function):
    """The chain of blocks as one function: forward in sequence order, backward in reverse."""

    @staticmethod
    def forward(ctx, spec: _Spec, *tensors):
        ctx.grad = any(ctx.needs_input_grad)            # (no graph where nothing asks for gradients: eval)
        n_in = sum(x is not None for x in spec.inputs)
        n_sh = len(spec.shared)
        data, shared, state = list(tensors[:n_in]), list(tensors[n_in:n_in + n_sh]), list(tensors[n_in + n_sh:])
        present = [x for x in spec.inputs if x is not None]
        leaves = {}
        outs: dict[int, list] = {}
        remat = current_policy().remat if ctx.grad else False
        for j, (dev, k) in enumerate(spec.order):
            if dev == spec.rank:
                # the block's graph is its own: no hook of the enclosing layer's checkpoint or offloading
                # (unpacked in backward, it would recompute the layer, communication included, at a point
                # of the chain that differs from device to device) and unseen by its selective modes; under
                # remat the block is checkpointed by itself, recomputed locally in the chain's backward
                with torch.set_grad_enabled(ctx.grad), outside_selective_checkpoint(), \
                        torch.autograd.graph.saved_tensors_hooks(_same_tensor, _same_tensor):
                    blocks = [_leaf(spec.slot(x, t, k)) for x, t in zip(present, data)]
                    sh, st = [_leaf(t) for t in shared], [_leaf(t) for t in state]
                    with serial_work(spec.devices):
                        o, new = _run_block(spec, k, blocks, sh, st, remat)
                leaves[j] = (blocks, sh, st, o, new)
                outs[k] = [t.detach() for t in o]
                state = [t.detach() for t in new]
            if j + 1 < len(spec.order):
                state = spec.send(state, dev, spec.order[j + 1][0])
        ctx.spec, ctx.leaves, ctx.n = spec, leaves, (n_in, n_sh, len(tensors) - n_in - n_sh)
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        slots = sorted(outs)
        return tuple(torch.cat([outs[k][i] for k in slots], dim=at) if len(slots) > 1 else outs[slots[0]][i]
                     for i, at in enumerate(spec.meta["seq_at"]))

    @staticmethod
    def backward(ctx, *grads):
        spec, leaves = ctx.spec, ctx.leaves
        n_in, n_sh, n_st = ctx.n
        mine = sorted(k for j, (dev, k) in enumerate(spec.order) if dev == spec.rank)
        g_outs = {k: [g.chunk(len(mine), dim=at)[mine.index(k)] if g is not None else None
                      for g, at in zip(grads, spec.meta["seq_at"])] for k in mine}
        g_blocks: dict[int, list] = {}
        g_shared = [None] * n_sh
        g_state = [torch.zeros(s, dtype=d, device=v) if d.is_floating_point else None
                   for s, d, v in ctx.shapes[n_in + n_sh:]]
        for j in reversed(range(len(spec.order))):
            dev, k = spec.order[j]
            if j + 1 < len(spec.order):
                g_state = spec.send(g_state, spec.order[j + 1][0], dev)
            if dev != spec.rank:
                continue
            blocks, sh, st, o, new = leaves[j]
            pairs = [(t, g) for t, g in zip(o + new, g_outs[k] + g_state) if g is not None and t.requires_grad]
            wrt = [t for t in blocks + sh + st if t.requires_grad]
            with serial_work(spec.devices):
                got = iter(torch.autograd.grad([t for t, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                           if pairs and wrt else [None] * len(wrt))
            got = [next(got) if t.requires_grad else None for t in blocks + sh + st]
            g_blocks[k] = [_zero_if_none(g, b) for b, g in zip(blocks, got[:len(blocks)])]
            for i, g in enumerate(got[len(blocks):len(blocks) + n_sh]):
                if g is not None:
                    g_shared[i] = g if g_shared[i] is None else g_shared[i] + g
            g_state = [_zero_if_none(g, s) for s, g in zip(st, got[len(blocks) + n_sh:])]
        present = [x for x in spec.inputs if x is not None]
        g_in = [None if g_blocks[mine[0]][i] is None else
                torch.cat([g_blocks[k][i] for k in mine], dim=x.dims.index(spec.seq)) for i, x in enumerate(present)]
        # the state's gradient reaches the initial state on the device of the first block
        g_init = g_state if spec.order[0][0] == spec.rank else [None] * n_st
        return (None, *g_in, *g_shared, *g_init)
