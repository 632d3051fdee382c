"""The ``torch.compile`` backend that runs graph passes on a traced step (docs/compile.md).

``compile=True`` (inductor) and ``compile="aot_eager"`` trace the step into one ATen graph;
:func:`graph_backend` runs these passes on it before it executes:

1. :func:`functional_pp.compile.recompute.reissue_for_backward`: tagged regions are computed
   again in backward instead of keeping their values: FSDP weights gathered again (ZeRO-3,
   tagged by functional_pp/parallel/fsdp/) and remat regions recomputed;
2. the caller's passes, in order: the training step's are the communication passes of the
   mechanisms that own them (functional_pp/parallel/step_backend.py: the gradient buckets'
   graph form, then FSDP's overlap of collectives);
3. :func:`functional_pp.compile.reinplace.reinplace` (graphs run op by op, not inductor):
   elementwise results are written into the buffers that die there;
4. (a function compiled on its own and differentiated by autograd, a ``compile="per_layer"``
   layer) :func:`functional_pp.compile.recompute.regather_in_backward` on the joint graph
   before AOT autograd's partition: FSDP weights gathered again in backward, not saved;
5. the collectives of the final graph (recomputed gathers included) are read from their
   tags, and every run of the compiled graph records them in the active
   :func:`functional_pp.comm_report`, as eager execution does.

Other backend names are passed to ``torch.compile`` unchanged (no passes, no counting).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from functional_pp._torch import compile_backend
from functional_pp.compile.recompute import (in_backward_region, probe_backward_marks, regather_in_backward,
                                             reissue_for_backward)
from functional_pp.compile.reinplace import reinplace
from functional_pp.core import comm
from functional_pp.core.runtime import per_thread, thread_local_value

_COLLECTIVE_NAMESPACES = ("fpp_sim", "_c10d_functional")


GraphPass = Callable[[torch.fx.Graph], Any]


def graph_backend(compile: bool | str, passes: Sequence[GraphPass] = ()) -> str | Callable:
    """The backend to hand ``torch.compile`` for ``compile`` (True: inductor, or a backend
    name) that runs the recomputation, ``passes`` and re-inplacing on the traced graph (see
    the module docstring). The training step's is functional_pp.parallel.step_backend."""
    name = "inductor" if compile is True else compile
    probe_backward_marks()
    # inductor plans buffer reuse itself; graphs run op by op write in place through reinplace
    return compile_backend(name, functools.partial(run_passes, passes=tuple(passes), in_place=name != "inductor"),
                           joint_pass=regather_in_backward) or name


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


def run_passes(graph: torch.fx.Graph, passes: Sequence[GraphPass] = (), in_place: bool = False):
    """Run the backend's passes on ``graph`` (see the module docstring); returns the wrapper
    that records the graph's collectives at every run of the compiled function."""
    reissue_for_backward(graph)
    for graph_pass in passes:
        graph_pass(graph)
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
