"""The bound on collectives in flight of the overlap pass (functional_pp/parallel/fsdp/graph.py,
docs/compile.md "Peak memory of compiled FSDP"), on a hand-built graph of torch.distributed
functional collectives: a backward that reduce-scatters four gradients and an optimizer that
reads them all at the end, the shape whose late waits used to keep every unsharded gradient
alive at once."""
import pytest
import torch

from functional_pp.compile.backend import run_passes
from functional_pp.core.policy import DEFAULT_IN_FLIGHT, Policy
from functional_pp.parallel.fsdp.graph import overlap_communication
from functional_pp.parallel.step_backend import step_passes

FUNCOL = torch.ops._c10d_functional
N_GRADS = 4


LAUNCHES = {
    "reduce_scatter": lambda grad: (FUNCOL.reduce_scatter_tensor.default, (grad, "sum", 2, "0")),
    "all_gather": lambda grad: (FUNCOL.all_gather_into_tensor.default, (grad, 2, "0")),
}


def _backward_graph(kind: str = "reduce_scatter") -> torch.fx.Graph:
    """Per gradient: its matmul, the collective's launch (a reduce-scatter, or any other kind)
    and its two waits (as funcol traces them); the optimizer (one subtraction per shard) after
    the whole backward."""
    g = torch.fx.Graph()
    x, dy = g.placeholder("x"), g.placeholder("dy")
    shards = [g.placeholder(f"w{i}") for i in range(N_GRADS)]
    reduced = []
    for _ in range(N_GRADS):
        grad = g.call_function(torch.ops.aten.mm.default, (x, dy))
        launch = g.call_function(*LAUNCHES[kind](grad))
        reduced.append(g.call_function(FUNCOL.wait_tensor.default,
                                       (g.call_function(FUNCOL.wait_tensor.default, (launch,)),)))
    new = [g.call_function(torch.ops.aten.sub.Tensor, (w, r)) for w, r in zip(shards, reduced)]
    g.output(tuple(new))
    return g


def _is_launch(n: torch.fx.Node) -> bool:
    return n.target in (FUNCOL.reduce_scatter_tensor.default, FUNCOL.all_gather_into_tensor.default)


def _max_in_flight(graph: torch.fx.Graph) -> int:
    """The most collectives launched and not yet waited for, walking the graph in order."""
    live, most = set(), 0
    for n in graph.nodes:
        if _is_launch(n):
            live.add(n)
        elif n.target is FUNCOL.wait_tensor.default:
            live.discard(n.args[0])
        most = max(most, len(live))
    return most


def _matmuls_overlapped(graph: torch.fx.Graph) -> list[int]:
    """For each collective: the matmuls between its launch and its first wait."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    mms = [pos[n] for n in nodes if n.target is torch.ops.aten.mm.default]
    out = []
    for n in nodes:
        if _is_launch(n):
            wait = next(iter(n.users))
            out.append(sum(pos[n] < i < pos[wait] for i in mms))
    return out


@pytest.mark.parametrize("kind", list(LAUNCHES))
@pytest.mark.parametrize("limit", [1, 2, 3])
def test_at_most_limit_collectives_in_flight_and_each_still_overlaps(limit, kind):
    g = _backward_graph(kind)
    overlap_communication(g, in_flight=limit)
    assert _max_in_flight(g) == limit
    # every collective but the last still runs while the next gradient's matmul computes
    assert all(b >= 1 for b in _matmuls_overlapped(g)[:-1]), _matmuls_overlapped(g)


def test_without_a_bound_late_waits_keep_every_reduce_scatter_in_flight():
    g = _backward_graph()
    overlap_communication(g, in_flight=0)
    assert _max_in_flight(g) == N_GRADS


def test_the_bound_and_the_overlap_are_step_policy_fields():
    """``Policy.collectives_in_flight`` (default 2) and ``Policy.overlap`` reach the compiled
    step's pass through its backend (parallel/step_backend.py); a bad bound is refused by name."""
    assert Policy().collectives_in_flight == DEFAULT_IN_FLIGHT == 2 and Policy().overlap is True
    for bad in (-1, "two", 1.5, True):
        with pytest.raises(ValueError, match="collectives_in_flight"):
            Policy(collectives_in_flight=bad)
    g = _backward_graph()
    overlap_communication(g)
    assert _max_in_flight(g) == DEFAULT_IN_FLIGHT
    for overlap, limit, most in ((True, 3, 3), (True, 0, N_GRADS), (False, 3, 1)):
        g = _backward_graph()
        run_passes(g, step_passes(overlap=overlap, in_flight=limit))
        assert _max_in_flight(g) == most, (overlap, limit)
