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

:data:`INDUCTOR_PATCHES` turns the first off and restores graph order after fusion: fused
kernels sorted by their *latest* member's position in the graph, then topologically sorted
(the order autograd produced: each weight gradient right after its layer's input gradient)."""
from __future__ import annotations

from typing import Any


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


# inductor config for a compiled training step (torch._inductor.config names)
INDUCTOR_PATCHES = {"reorder_for_locality": False, "_post_fusion_custom_pass": restore_graph_order}
