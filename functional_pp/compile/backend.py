"""The ``torch.compile`` backend of the training step (docs/compile.md).

``compile=True`` (inductor) and ``compile="aot_eager"`` trace the step into one ATen graph
and run these passes on it before it executes:

1. :func:`functional_pp.compile.recompute.reissue_for_backward`: FSDP weights are gathered again in
   backward (ZeRO-3) and remat regions are recomputed, instead of keeping their values (an FSDP
   unit's weights with one flat all-gather, as traced by ``parallel/fsdp_units.py``);
2. :func:`functional_pp.compile.buckets.bucket_all_reduces`: the gradient all-reduces are
   grouped into buckets of ``bucket_mb``, as eager steps group them;
3. :func:`functional_pp.compile.overlap.overlap_communication` (torch.distributed only; on by
   default, the step policy's ``overlap=False`` keeps trace order): all-gathers are prefetched
   one weight ahead and waits sink to the first use of their result, with at most the policy's
   ``collectives_in_flight`` (default 2) collectives of a kind in flight;
4. :func:`functional_pp.compile.reinplace.reinplace` (graphs run op by op, not inductor):
   elementwise results are written into the buffers that die there;
5. the collectives of the final graph (recomputed gathers included) are read from their
   tags, and every run of the compiled graph records them in the active
   :func:`functional_pp.comm_report`, as eager execution does.

Other backend names are passed to ``torch.compile`` unchanged (no passes, no counting).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from functional_pp._torch import compile_backend
from functional_pp.compile.buckets import bucket_all_reduces
from functional_pp.compile.overlap import overlap_communication
from functional_pp.compile.recompute import in_backward_region, probe_backward_marks, reissue_for_backward
from functional_pp.compile.reinplace import reinplace
from functional_pp.core import comm
from functional_pp.core.policy import DEFAULT_IN_FLIGHT
from functional_pp.core.runtime import per_thread, thread_local_value

_COLLECTIVE_NAMESPACES = ("fpp_sim", "_c10d_functional")


@functools.lru_cache(maxsize=None)
def step_backend(compile: bool | str, bucket_mb: float | None = None, overlap: bool = True,
                 in_flight: int = DEFAULT_IN_FLIGHT) -> str | Callable:
    """The backend to hand ``torch.compile`` for ``train_step(compile=...)``; ``bucket_mb``:
    the step's gradient all-reduce buckets (None: one all-reduce per gradient); ``overlap`` and
    ``in_flight``: the step policy's ``overlap`` and ``collectives_in_flight``."""
    name = "inductor" if compile is True else compile
    probe_backward_marks()
    # inductor plans buffer reuse itself; graphs run op by op write in place through reinplace
    return compile_backend(name, functools.partial(_step_pass, in_place=name != "inductor",
                                                   bucket_mb=bucket_mb, overlap=overlap,
                                                   in_flight=in_flight)) or name


def _is_collective(node: torch.fx.Node) -> bool:
    target = node.target
    ns = getattr(target, "namespace", None)
    return (node.op == "call_function" and ns in _COLLECTIVE_NAMESPACES
            and "wait" not in getattr(target, "__name__", ""))


def graph_collectives(graph: torch.fx.Graph) -> list[tuple[tuple, bool]]:
    """``(tag, in_backward)`` of every tagged collective of a traced step, in graph order."""
    out = []
    for node in graph.nodes:
        tag = (node.meta.get("custom") or {}).get(comm.TRACED)
        if tag is not None and _is_collective(node):
            out.append((tag, in_backward_region(node)))
    return out


_local = per_thread("compile.backend")


@contextmanager
def capture_graphs() -> Iterator[list[torch.fx.Graph]]:
    """Collect the final graphs of the steps compiled on this thread inside the block (for
    inspecting what a compiled step keeps, recomputes and communicates)."""
    with thread_local_value(_local, "graphs", []) as graphs:
        yield graphs


def _step_pass(graph: torch.fx.Graph, in_place: bool = False, bucket_mb: float | None = None,
               overlap: bool = True, in_flight: int = DEFAULT_IN_FLIGHT):
    reissue_for_backward(graph)
    bucket_all_reduces(graph, bucket_mb)
    if overlap:                                       # False: trace order (debugging)
        overlap_communication(graph, in_flight)
    if in_place:
        reinplace(graph)
    graph.lint()          # every pass kept each node after its inputs (a clear error, not a NameError at run time)
    if getattr(_local, "graphs", None) is not None:
        _local.graphs.append(graph)
    events = comm.traced_events(graph_collectives(graph))

    def wrap(compiled: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args):
            comm.replay(events)
            return compiled(*args)
        return run
    return wrap
