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
on the reduce-scatter stream. The dry-run gathers per weight; its gathered weights stand for
the copy-outs, on the compute stream."""
from __future__ import annotations

from typing import Sequence

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
