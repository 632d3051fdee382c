"""The ``torch.compile`` backend of the training step (docs/compile.md): compile's graph backend
(functional_pp/compile/backend.py: recomputation, re-inplacing, the collectives counted) with
the graph forms of the communication mechanisms in between, in this order:

1. the gradient buckets' pass (functional_pp/parallel/buckets/graph.py): the gradient
   all-reduces grouped into buckets of ``bucket_mb``, as eager steps group them;
2. FSDP's overlap of collectives (functional_pp/parallel/fsdp/graph.py; torch.distributed only;
   the step policy's ``overlap=False`` keeps trace order): all-gathers prefetched one weight
   ahead, waits sunk to the first use of their result, at most the policy's
   ``collectives_in_flight`` (default 2) collectives of a kind in flight.
"""
from __future__ import annotations

import functools
from typing import Callable

from functional_pp.compile.backend import GraphPass, graph_backend
from functional_pp.core.policy import DEFAULT_IN_FLIGHT
from functional_pp.parallel.buckets.graph import bucket_all_reduces
from functional_pp.parallel.fsdp.graph import overlap_communication


def step_passes(bucket_mb: float | None = None, overlap: bool = True,
                in_flight: int = DEFAULT_IN_FLIGHT) -> tuple[GraphPass, ...]:
    """The communication passes of a compiled training step, in order (see the module
    docstring): ``bucket_mb``, ``overlap`` and ``in_flight`` are the step policy's
    ``bucket_mb``, ``overlap`` and ``collectives_in_flight``."""
    passes: list[GraphPass] = [functools.partial(bucket_all_reduces, bucket_mb=bucket_mb)]
    if overlap:                                       # False: trace order (debugging)
        passes.append(functools.partial(overlap_communication, in_flight=in_flight))
    return tuple(passes)


@functools.lru_cache(maxsize=None)
def step_backend(compile: bool | str, bucket_mb: float | None = None, overlap: bool = True,
                 in_flight: int = DEFAULT_IN_FLIGHT) -> str | Callable:
    """The backend to hand ``torch.compile`` for ``train_step(compile=...)``; ``bucket_mb``:
    the step's gradient all-reduce buckets (None: one all-reduce per gradient); ``overlap`` and
    ``in_flight``: the step policy's ``overlap`` and ``collectives_in_flight``."""
    return graph_backend(compile, step_passes(bucket_mb, overlap, in_flight))
