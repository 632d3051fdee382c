"""Communication overlap in a compiled FSDP step on torch.distributed (functional_pp/parallel/fsdp/graph.py,
docs/compile.md): read from the compiled graph's node order on two real gloo processes, with
results equal to the step compiled without the pass."""
import functools

import pytest
import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp.compile.backend import capture_graphs
from functional_pp.models import llama

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

CFG = llama.Config.tiny(layers=2)


def _kind(node):
    t = node.target
    if node.op != "call_function" or getattr(t, "namespace", None) != "_c10d_functional":
        return None
    return "wait" if "wait" in t.__name__ else t.__name__.split(".")[0]


def _order(graph):
    """For every all-gather and reduce-scatter, in graph order: how many matmuls run between
    its launch and its wait (the computation it overlaps)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    mm = [i for i, n in enumerate(nodes) if n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0]
          in ("mm", "bmm", "addmm")]
    out = []
    for n in nodes:
        kind = _kind(n)
        if kind not in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            continue
        wait = next(u for u in n.users if _kind(u) == "wait")
        between = sum(1 for i in mm if pos[n] < i < pos[wait])
        out.append((kind, between))
    return out


def _most_in_flight(graph, kind):
    """The most collectives of ``kind`` launched and not yet waited for, in graph order."""
    live, most = set(), 0
    for n in graph.nodes:
        if _kind(n) == kind:
            live.add(n)
        elif _kind(n) == "wait":
            live.discard(n.args[0])
        most = max(most, len(live))
    return most


def _device(overlap):
    mesh, rules = fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard")
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-2), mesh=mesh,
                          rules=rules, compile="aot_eager", overlap=overlap)
    full = make_batch(CFG, batch=4, seq=16)
    r = fpp.current_rank()
    batch = {k: v[2 * r:2 * r + 2] for k, v in full.items()}
    state = step.init(fpp.init(llama.init, CFG, torch.float32, mesh=mesh, rules=rules, seed=0))
    losses = []
    with capture_graphs() as graphs:
        for _ in range(2):
            state, m = step(state, batch)
            losses.append(m["loss"])
    in_flight = {k: _most_in_flight(graphs[0], k) for k in ("all_gather_into_tensor", "reduce_scatter_tensor")}
    return losses, state["params"], _order(graphs[0]), in_flight


@pytest.mark.timeout(1500)
def test_compiled_fsdp_prefetches_gathers_and_overlaps_reduce_scatters_on_gloo():
    mesh = fpp.Mesh(dp_shard=2)
    plain = fpp.launch(functools.partial(_device, False), mesh, processes=True, timeout=900)
    over = fpp.launch(functools.partial(_device, True), mesh, processes=True, timeout=900)
    for (l0, p0, _, _), (l1, p1, _, _) in zip(plain, over):
        assert l1 == l0
        for (path, a), (_, b) in zip(fpp.leaves_with_paths(p1), fpp.leaves_with_paths(p0)):
            assert torch.equal(a, b), path
    base, order = plain[0][2], over[0][2]
    assert sorted(k for k, _ in base) == sorted(k for k, _ in order)     # the same collectives
    # trace order: every collective is waited for before any computation runs
    assert all(between == 0 for _, between in base), base
    # overlapped: the gathers of the next layer unit run while the current one computes (every
    # unit but the first, in forward and again for the backward re-gathers; the root weights',
    # one each, have no matmul before them), and the gradients' reduce-scatters run while
    # backward goes on (those of the first layer's weights, last in backward, have no matmul left)
    gathers = [b for k, b in order if k.startswith("all_gather")]
    scatters = [b for k, b in order if k.startswith("reduce_scatter")]
    assert sum(b > 0 for b in gathers) >= 2 * (CFG.layers - 1), order
    assert sum(b > 0 for b in scatters) >= len(scatters) // 2, order
    # ... but at most two of a kind at a time (the policy's collectives_in_flight default): a
    # reduce-scatter holds its unsharded gradient until its wait (docs/compile.md)
    assert plain[0][3] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, plain[0][3]
    assert over[0][3] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, over[0][3]
