"""Parameters gathered at several sites of one forward (a tied embedding the model did not
declare with ``fpp.tied``, a weight shared by several layers): the training step records, in its
first forward on each device, the order in which parameter shards are all-gathered with gradient
(by an op or an FSDP unit), and from the next forward on hands those gathered more than once per
model pass to the model as tied (``functional_pp.tied``): one all-gather in forward, one
reduce-scatter in backward (docs/layouts.md, "Tied parameters").

A loss that runs the model several times (DPO's chosen and rejected forwards) repeats the
same sequence of gathers: the sequence is cut into its shortest repeating pass and only the
gathers within one pass count, so such a loss keeps ZeRO-3 (each pass gathers and re-gathers
per layer) instead of holding every weight gathered from forward to backward.

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
def counting(enabled: bool = True) -> Iterator[list[int] | None]:
    """Record the gathers of parameter shards in the block, in order (None when not ``enabled``)."""
    previous = getattr(_local, "uses", None)
    _local.uses = uses = [] if enabled else None
    try:
        yield uses
    finally:
        _local.uses = previous


def record(shard: torch.Tensor) -> None:
    """A parameter whose block is ``shard`` was all-gathered (inside :func:`counting`). Not
    counted inside a compiled region (a ``compile="per_layer"`` layer): dynamo cannot carry
    ``id()`` across a graph break, and the step counts only in eager forwards. Nor without
    gradient (a frozen reference's forward on the same weights): such a gather has no backward
    to share."""
    if is_tracing() or not torch.is_grad_enabled():
        return
    uses = getattr(_local, "uses", None)
    if uses is not None:
        uses.append(id(_root(shard)))


def one_pass(sequence: Sequence[int]) -> Sequence[int]:
    """The shortest prefix of ``sequence`` that ``sequence`` repeats whole (the model's pass when
    a loss runs it several times; ``sequence`` itself when it does not repeat)."""
    n = len(sequence)
    for p in range(1, n // 2 + 1):
        if n % p == 0 and all(sequence[i] == sequence[i % p] for i in range(p, n)):
            return sequence[:p]
    return sequence


def gathered_more_than_once(uses: Sequence[int], blocks: Sequence[torch.Tensor]) -> frozenset[int]:
    """The positions of the parameter ``blocks`` (the forward's, in order) gathered more than
    once in one pass of the gathers ``uses`` recorded (:func:`one_pass`; gathers of other
    tensors, a reference model's, left out)."""
    ids = {id(_root(t)) for t in blocks}
    counts = Counter(one_pass([u for u in uses if u in ids]))
    return frozenset(i for i, t in enumerate(blocks) if counts.get(id(_root(t)), 0) > 1)


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
