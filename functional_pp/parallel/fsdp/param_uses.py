"""Parameters gathered at several sites of one forward (a tied embedding the model did not
declare with ``fpp.tied``, a weight shared by several layers): the training step counts, in its
first forward on each device, how many times each parameter's shard is all-gathered (by an op
or an FSDP unit), and from the next forward on hands those gathered more than once to the model
as tied (``functional_pp.tied``): one all-gather in forward, one reduce-scatter in backward
(docs/layouts.md, "Tied parameters").

Mechanism: FSDP (parameters used at several sites gathered once; eager).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from functional_pp._torch import is_tracing
from functional_pp.core.runtime import per_thread

_local = per_thread("parallel.fsdp.param_uses")


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


@contextmanager
def counting(enabled: bool = True) -> Iterator[Counter | None]:
    """Count the gathers of parameter shards in the block (None when not ``enabled``)."""
    previous = getattr(_local, "uses", None)
    _local.uses = uses = Counter() if enabled else None
    try:
        yield uses
    finally:
        _local.uses = previous


def record(shard: torch.Tensor) -> None:
    """A parameter whose block is ``shard`` was all-gathered (inside :func:`counting`). Not
    counted inside a compiled region (a ``compile="per_layer"`` layer): dynamo cannot carry
    ``id()`` across a graph break, and the step counts only in eager forwards."""
    if is_tracing():
        return
    uses = getattr(_local, "uses", None)
    if uses is not None:
        uses[id(_root(shard))] += 1


def gathered_more_than_once(uses: Counter, blocks: Sequence[torch.Tensor]) -> frozenset[int]:
    """The positions of the parameter ``blocks`` (the forward's, in order) that ``uses``
    counted more than once."""
    return frozenset(i for i, t in enumerate(blocks) if uses.get(id(_root(t)), 0) > 1)


@contextmanager
def declaring() -> Iterator[list]:
    """The parameter values the block's forward declared tied (``functional_pp.tied``), in order
    (a compiled step keeps the gradients of those out of its update kernel: step/train.py)."""
    previous = getattr(_local, "declared", None)
    _local.declared = found = []
    try:
        yield found
    finally:
        _local.declared = previous


def declare_tied(data: torch.Tensor) -> None:
    """``data`` was declared tied (inside :func:`declaring`)."""
    found = getattr(_local, "declared", None)
    if found is not None:
        found.append(data)


def declared_positions(found: Sequence[torch.Tensor], blocks: Sequence[torch.Tensor]) -> frozenset[int]:
    """The positions of the parameter ``blocks`` (the forward's, in order) among ``found``."""
    ids = {id(_root(t)) for t in found}
    return frozenset(i for i, t in enumerate(blocks) if id(_root(t)) in ids)
