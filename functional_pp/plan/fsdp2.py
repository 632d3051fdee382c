"""The buffers torch's FSDP2 (``fully_shard``, torchtitan's) allocates for its collectives,
replayed on the allocator model from the weights a dry-run gathered (docs/planning.md,
"Reserved memory"; ``estimate(..., fsdp2_streams=True)``).

FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, _fsdp_param_group.py)
all-gathers a unit, one layer's parameters, into one flat buffer allocated on its all-gather
copy-in stream, copies it out into the unsharded parameters on the compute stream, and frees
it: in forward only once the next unit's buffer is allocated (``AllGatherState``: the copy-out
overlaps the next all-gather), in backward after its own copy-out (the next unit is prefetched
after it). The parameters outside the layers are the root unit, gathered at the start of
forward and not resharded until the end of backward. Its reduce-scatter outputs are allocated
on the reduce-scatter stream and are the sharded gradients, held until the next step's
``zero_grad`` (:func:`held_gradients`). The dry-run gathers per weight; its gathered weights
stand for the copy-outs, on the compute stream."""
from __future__ import annotations

from typing import Sequence

import torch

from functional_pp.core.layout import local_shape
from functional_pp.core.tree import leaves_with_paths
from functional_pp.plan.allocator import CachingAllocator

ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = "all_gather", "reduce_scatter"

#: a unit of gathers: (layer or None outside the layers, phase, recomputing)
Unit = tuple


def units(gathers: Sequence[tuple[Unit, int]]) -> list[tuple[int, bool]]:
    """FSDP2's all-gather buffers in order, as (bytes, in forward), from the dry-run's gathers
    ``gathers`` ((unit, bytes) in order): the weights a layer gathers in one phase are a unit;
    those outside the layers gathered in a forward are one root unit at its start, and none
    is gathered again before the next forward."""
    out: list[list] = []
    root: list | None = None
    in_forward = False
    for (layer, phase, recomputing), nbytes in gathers:
        forward = phase == "forward" and not recomputing
        if forward and not in_forward:       # a forward begins: its root unit first
            root = [0, True]
            out.append(root)
        in_forward = forward
        if layer is None:
            if forward:
                root[0] += nbytes
            continue
        if out and out[-1] is not root and out[-1][2:] == [(layer, phase, recomputing)]:
            out[-1][0] += nbytes
        else:
            out.append([nbytes, forward, (layer, phase, recomputing)])
    return [(n, forward) for n, forward, *_ in out if n]


def replay(allocator: CachingAllocator, gathers: Sequence[tuple[Unit, int]]) -> None:
    """Allocate and free each unit's flat buffer on the all-gather stream, as FSDP2 does."""
    held = None
    for i, (nbytes, forward) in enumerate(units(gathers)):
        key = ("fsdp2 all-gather", i)
        allocator.malloc(key, nbytes, ALL_GATHER_STREAM)
        if held is not None:
            allocator.free(held)
        held = key if forward else None
        if not forward:
            allocator.free(key)


def held_gradients(units: Sequence[int], micro_steps: int = 1, expandable_segments: bool = False) -> int:
    """The bytes FSDP2's reduce-scatter stream reserves for a step's sharded gradients ``units``
    (bytes of each unit's flat buffer, in backward order: each layer's, the last first, then the
    root's, which FSDP2 reduce-scatters in the root's post-backward, at the end of backward).
    ``foreach_reduce`` allocates each unit's reduce-scatter output on that stream and makes the
    unit's sharded gradients views of it
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: "the GPU sharded gradient is
    allocated in the RS stream"); they live until the optimizer has stepped and the next step's
    ``optimizer.zero_grad()`` (torchtitan's train loop, first in each step; ``set_to_none``)
    drops them, and the next step's outputs, of the same sizes, reuse the blocks: the pool holds
    them all, cached while the next step's forward runs. With micro-steps each later one's
    output is added into the held gradients (``grad += ...``) and freed."""
    allocator = CachingAllocator(expandable_segments)
    for i, nbytes in enumerate(units):
        allocator.malloc(("fsdp2 gradient", i), nbytes, REDUCE_SCATTER_STREAM)
    for _ in range(max(1, micro_steps) - 1):
        for i, nbytes in enumerate(units):
            allocator.malloc(("fsdp2 accumulated", i), nbytes, REDUCE_SCATTER_STREAM)
            allocator.free(("fsdp2 accumulated", i))
    return allocator.reserved


def sharded_gradients(decls, repeated: str | None, mesh, rules, trainable=None) -> list[int]:
    """FSDP2's units' sharded gradients in the order its reduce-scatters leave them: one flat
    buffer per layer of ``decls[repeated]`` (the last first), then the root unit's (every
    parameter outside the layers, torchtitan's ``fully_shard(model)``), each the sum of its
    trainable parameters' shards in fp32 (torchtitan's ``reduce_dtype``; the shards' own dtype)."""
    flags = dict(leaves_with_paths(trainable(decls))) if trainable is not None else {}
    n = layer_count(decls, repeated)
    units = [0] * (n + 1)
    for path, d in leaves_with_paths(decls):
        if not (flags.get(path, True) and d.dtype.is_floating_point):
            continue
        i = _layer_of(path, repeated, n)
        i = n if i is None else i
        shape = local_shape(d.shape, rules.resolve(d.dims, d.shape, mesh, path), mesh)
        units[i] += 4 * int(torch.Size(shape).numel())
    return [u for u in units[n - 1::-1] + units[n:] if u]      # (the layers' last first, the root's last)


def held_unsharded(decls, repeated: str | None, mesh, rules, float8_all_gather: bool = False,
                   itemsize: int = 2) -> tuple[int, int]:
    """The bytes of (the root unit, the last layer) that FSDP2 holds unsharded from their forward
    gather to the end of their backward, as torchtitan shards: its root (every parameter
    outside the layers) because FSDP2 does not reshard the root after forward
    (``FSDPState._lazy_init``: ``post_forward_mesh_info = None``), its last layer because
    torchtitan's ``apply_fsdp`` passes ``reshard_after_forward=int(layer_id) < len(layers) - 1``
    (9dec370; e7c0cae's default policy the same). Each parameter gathered over FSDP's axis
    (``dp_shard``), in ``itemsize`` bytes (the step's 16 bits), the last layer's matrices in
    one byte with ``float8_all_gather``."""
    gathered = type(mesh)(**{**dict(mesh.shape), "dp_shard": 1})
    n = layer_count(decls, repeated)
    root = last = 0
    for path, d in leaves_with_paths(decls):
        layer = _layer_of(path, repeated, n)
        if layer is not None and layer != n - 1:
            continue
        numel = int(torch.Size(local_shape(d.shape, rules.resolve(d.dims, d.shape, gathered, path), gathered)).numel())
        if layer is None:
            root += itemsize * numel
        else:
            last += (1 if float8_all_gather and len(d.shape) >= 2 else itemsize) * numel
    return root, last


def layer_count(decls, repeated: str | None) -> int:
    """How many layers ``decls[repeated]`` holds (0: no list of layers)."""
    layers_list = decls.get(repeated) if isinstance(decls, dict) and repeated else None
    return len(layers_list) if isinstance(layers_list, list) else 0


def _layer_of(path: str, repeated: str | None, n: int) -> int | None:
    """The layer of ``decls[repeated]`` a parameter path is in (``layers.3.mlp.up`` -> 3), or None
    for a parameter outside the layers (FSDP2's root unit)."""
    parts = path.split(".")
    return int(parts[1]) if n and parts[0] == repeated and len(parts) > 1 and parts[1].isdigit() else None
