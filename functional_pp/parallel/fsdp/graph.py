"""FSDP in a compiled step (docs/compile.md): the graph forms of ``regather.py`` and ``units.py``.

While dynamo traces, a weight's all-gather (a weight's or a unit's) runs inside
:func:`regather_region`: its nodes are tagged, and compile's recomputation pass
(functional_pp/compile/recompute.py, ``reissue_for_backward``) gathers it again in backward
(ZeRO-3) instead of keeping the gathered weight, as eager's re-gather hooks do.

Then :func:`overlap_communication`, the step's last communication pass
(functional_pp/parallel/step_backend.py), does what eager's prefetch and in-flight bound do.
torch.distributed's functional collectives are split in the graph into a launch
(``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...) and a ``wait_tensor``. Two moves
let the network work while the CPU/GPU computes, and a bound keeps what they hold in check:

* prefetch: the launch of each FSDP weight's all-gather moves before the computation that
  uses the previous gathered weight, in forward and again for the backward re-gathers, so
  layer i+1's weights are on their way while layer i computes;
* late waits: every wait, with the views, casts and elementwise ops that only transform its
  result, moves down to just before the first other node that reads them, so a gradient's
  reduce-scatter runs while the backward of the next layers computes;
* a bound on collectives in flight: an asynchronous collective holds its input until its
  wait, so late waits alone would keep every layer's unsharded gradient alive until the
  optimizer. The wait of the k-th collective of a kind moves up before the launch of the
  (k+N)-th (N = the step policy's ``collectives_in_flight``, default 2; 0: no bound; the
  same bound as eager steps'), as FSDP2 waits for
  one reduce-scatter before it issues the next ones (docs/compile.md, "Peak memory of
  compiled FSDP").

Simulated collectives are one synchronous op each; there is nothing to overlap, so the
simulated graph is left in trace order.

Mechanism: FSDP (gathers tagged for the re-gather in backward; prefetched, waits sunk, collectives in flight bounded; compiled).
"""
from __future__ import annotations

import torch

from functional_pp._torch import OpOverload
from functional_pp.compile.recompute import VIEW_OR_CAST, is_backward, op_name, tag_region
from functional_pp.core.graph_tags import LEAF, REGATHER
from functional_pp.core.policy import DEFAULT_IN_FLIGHT

_FUNCOL = "_c10d_functional"


def regather_region(enabled: bool = True):
    """Context for an FSDP weight's all-gather (or a unit's): under compile, backward gathers
    it again (ZeRO-3) instead of keeping it; nothing when not ``enabled`` or not tracing."""
    return tag_region(REGATHER, enabled)


def _is_launch(node: torch.fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and getattr(t, "namespace", None) == _FUNCOL and "wait" not in t.__name__


def _is_wait(node: torch.fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and getattr(t, "namespace", None) == _FUNCOL and "wait" in t.__name__


def _region(node: torch.fx.Node):
    return (node.meta.get("custom") or {}).get(REGATHER)


def _first_consumer(graph_pos: dict, launch: torch.fx.Node) -> torch.fx.Node | None:
    """The first node that reads the collective's result (through its wait)."""
    consumers = [c for u in launch.users for c in (u.users if _is_wait(u) else [u])]
    return min(consumers, key=graph_pos.__getitem__) if consumers else None


def _follows(node: torch.fx.Node) -> bool:
    """Cheap ops that move with a wait: views, casts and elementwise math (a reduce-scattered
    gradient's scaling, its accumulation into the shard's gradient)."""
    t = node.target
    if _is_wait(node):          # a wait on a waited value (funcol waits twice): a no-op
        return True
    return node.op == "call_function" and (op_name(node) in VIEW_OR_CAST or (
        isinstance(t, OpOverload) and torch.Tag.pointwise in t.tags))


def _sink(wait: torch.fx.Node) -> int:
    """Move a wait, with the cheap ops that only transform its result (views, casts,
    elementwise math on it and on values computed before the wait), down to the first other
    node that reads them: for a gradient's reduce-scatter, the optimizer, after the rest of
    backward."""
    pos = {n: i for i, n in enumerate(wait.graph.nodes)}
    group, frontier = [wait], [wait]
    while frontier:
        for u in frontier.pop().users:
            if u not in group and _follows(u) and all(
                    a in group or pos[a] < pos[wait] for a in u.all_input_nodes):
                group.append(u)
                frontier.append(u)
    consumers = [u for n in group for u in n.users if u not in group]
    if not consumers:
        return 0
    first = min(consumers, key=pos.__getitem__)
    if all(pos[n] >= pos[first] - len(group) for n in group):
        return 0                                  # already right before its reader
    for n in sorted(group, key=pos.__getitem__):
        first.prepend(n)
    return 1


def _seeded_leaf(node: torch.fx.Node) -> bool:
    """A parameter made differentiable as ``p + seed`` (or backward's copy of it)."""
    return LEAF in (node.meta.get("custom") or {})


def _move_before(graph_pos: dict, node: torch.fx.Node, anchor: torch.fx.Node) -> bool:
    """Move ``node`` and the inputs it needs that come after ``anchor`` to just before
    ``anchor``; refuse (False) if that would need more than a few cheap, input-only nodes
    (views and concatenations, as an FSDP unit's flat shards, do not count, nor do seeded
    leaves' copies ``p + seed``: torch 2.11's path, one per parameter of the unit,
    _torch/grad_leaves.py)."""
    chain, stack, costly = [], [node], 0
    while stack:
        n = stack.pop()
        if graph_pos[n] < graph_pos[anchor] or n in chain:
            continue
        if n is not node:
            if n.op != "call_function":
                return False
            if op_name(n) not in VIEW_OR_CAST and op_name(n) != "cat" and not _seeded_leaf(n):
                costly += 1
                if costly > 8:
                    return False
        chain.append(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(chain, key=graph_pos.__getitem__):
        anchor.prepend(n)
    return True


def _kind(launch: torch.fx.Node) -> str:
    return launch.target.__name__.split(".")[0]


def _waits(launch: torch.fx.Node) -> list[torch.fx.Node]:
    """The waits of a launch: its ``wait_tensor`` and the waits on that (funcol waits twice)."""
    out, frontier = [], [u for u in launch.users if _is_wait(u)]
    while frontier:
        w = frontier.pop()
        out.append(w)
        frontier.extend(u for u in w.users if _is_wait(u))
    return out


def bound_in_flight(graph: torch.fx.Graph, limit: int) -> int:
    """Move waits up so that at most ``limit`` collectives of each kind are in flight: the
    waits of the k-th launch of a kind come before the (k+limit)-th launch. Waits depend only
    on their launch, so the move keeps every dependency. Returns the number of waits moved."""
    if limit <= 0:
        return 0
    launches: dict[str, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if _is_launch(n):
            launches.setdefault(_kind(n), []).append(n)
    moved, pos = 0, None
    for same in launches.values():
        for earlier, later in zip(same, same[limit:]):
            pos = pos or {n: i for i, n in enumerate(graph.nodes)}
            late = sorted((w for w in _waits(earlier) if pos[w] > pos[later]), key=pos.__getitem__)
            for w in late:
                later.prepend(w)
            if late:
                moved, pos = moved + len(late), None      # positions changed
    return moved


def overlap_communication(graph: torch.fx.Graph, in_flight: int = DEFAULT_IN_FLIGHT) -> int:
    """Prefetch FSDP all-gathers and sink waits in a graph of torch.distributed collectives,
    with at most ``in_flight`` collectives of a kind in flight (0: no bound; the step passes
    its policy's ``collectives_in_flight``). Returns the number of nodes moved."""
    if not any(_is_launch(n) for n in graph.nodes):
        return 0
    limit = in_flight
    moved = 0
    # late waits
    for wait in [n for n in graph.nodes if _is_wait(n)]:
        moved += _sink(wait)
    # prefetch, separately in forward and in backward
    nodes = list(graph.nodes)
    first_bwd = next((i for i, n in enumerate(nodes) if is_backward(n)), len(nodes))
    for part in (nodes[:first_bwd], nodes[first_bwd:]):
        launches = [n for n in part if _is_launch(n) and _region(n) is not None and "all_gather" in n.target.__name__]
        for prev, cur in zip(launches, launches[1:]):
            pos = {n: i for i, n in enumerate(graph.nodes)}
            consumer = _first_consumer(pos, prev)
            if consumer is not None and pos[consumer] < pos[cur] and _move_before(pos, cur, consumer):
                moved += 1
    moved += bound_in_flight(graph, limit)
    graph.lint()
    return moved
