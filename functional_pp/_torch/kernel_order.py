"""The order in which inductor runs the kernels of a compiled training step (docs/compile.md
"Kernel order").

A whole-step graph has no forward/backward partition: a weight gradient ``x.T @ dy`` has no
user until the optimizer. Two inductor passes then move every weight gradient to the end of
backward, which keeps all saved activations alive until the optimizer (+57 MiB, a 1.14x peak
on the 20 M model; docs/memory.md "Donated state"):

* ``reorder_for_locality`` (FX) moves a node next to its first user: the optimizer;
* fusion sorts fused kernels by their *earliest* member; a backward kernel fused with a
  forward value it recomputes (rotary tables, norms) sorts before the weight-gradient matmuls
  of the same layer, and the topological sort leaves those last.

:func:`inductor_patches` turns the first off and restores graph order after fusion: fused
kernels sorted by their *latest* member's position in the graph, then topologically sorted
(the order autograd produced: each weight gradient right after its layer's input gradient).
It also turns off inductor's peak-memory reorder, which runs after every other pass and, on a
whole step, moved the tied head's weight gradient after every layer's backward (the logits'
gradient alive through them: 1.11x plain torch's compiled peak instead of 0.97x)."""
from __future__ import annotations

from typing import Any

import torch

from functional_pp._torch.version import parse


def restore_graph_order(nodes: list[Any]) -> list[Any]:
    """Inductor scheduler nodes (after fusion) in the order of their latest member's FX node
    in the graph being compiled, dependencies first (a valid schedule of the same kernels)."""
    from torch._inductor.virtualized import V

    position = {n: i for i, n in enumerate(V.graph.module.graph.nodes)}

    def latest(node: Any) -> int:
        spots = [position[o] for sub in node.get_nodes() if sub.node is not None
                 for o in sub.node.origins if o in position]
        return max(spots, default=-1)

    keys = {n: latest(n) for n in nodes}
    order = sorted(nodes, key=keys.__getitem__)       # stable: ties keep inductor's order
    producer = {name: n for n in order for name in n.get_buffer_names()}
    seen: set = set()
    out: list[Any] = []

    def visit(node: Any) -> None:          # iterative DFS: graphs have thousands of kernels
        stack = [(node, False)]
        while stack:
            n, done = stack.pop()
            if done:
                out.append(n)
                continue
            if n in seen:
                continue
            seen.add(n)
            stack.append((n, True))
            deps = [producer.get(d.name) for d in sorted(n.unmet_dependencies, key=lambda d: d.name)]
            stack.extend((d, False) for d in reversed(deps) if d is not None and d is not n and d not in seen)

    for n in order:
        visit(n)
    return out


def loop_reordering_reliable(version: str = torch.__version__) -> bool:
    """Capability: whether inductor's loop reordering during fusion (``loop_ordering_after_fusion``)
    compiles a whole training step. torch 2.11's fails on CUDA with ``AssertionError`` in
    ``Scheduler.reorder_loops_by_dep_pair`` (``assert isinstance(snode, SchedulerNode)``: a fused
    node reached it) for every Llama step tried on an H200 (1 and 16 layers, tied or not);
    with the reordering off the same steps compile and train. Known from that run, not
    probed: the failure needs a CUDA graph of the whole step to show."""
    return parse(version) >= (2, 12)


def inductor_patches(version: str = torch.__version__) -> dict:
    """inductor config for a compiled training step (torch._inductor.config names)."""
    patches = {"reorder_for_locality": False, "_post_fusion_custom_pass": restore_graph_order,
               "reorder_for_peak_memory": False}
    if not loop_reordering_reliable(version):
        patches["loop_ordering_after_fusion"] = False
    return patches
