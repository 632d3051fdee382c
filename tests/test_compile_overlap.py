"""Overlap in a compiled FSDP step on torch.distributed (gloo processes), read from the
compiled graph's order (docs/compile.md): each weight's all-gather is launched before the
computation on the previous weight, and reduce-scatters are waited for only where their
result is read."""
import functools

import pytest
import torch

import functional_pp as fpp
from functional_pp.compiler import capture_graphs
from functional_pp.models import llama
from functional_pp.overlap import _is_launch, _is_wait
from functional_pp.recompute import REGATHER
from functional_pp.torch_private import is_backward_node

from harness import local_batch, make_batch

pytestmark = pytest.mark.multiprocess

CFG = llama.Config.tiny(layers=1)
MESH, RULES = fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard")


def _compute(n):
    return n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] in ("mm", "bmm", "addmm")


def _order_facts():
    """Per gather: (launch position, position of the first matmul on the previous gathered
    weight); per reduce-scatter: (launch, wait, matmuls in between)."""
    torch._dynamo.reset()
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.sgd(0.1), mesh=MESH, rules=RULES,
                          compile="aot_eager")
    state = step.init(fpp.init(llama.init, CFG, torch.float32, mesh=MESH, rules=RULES, seed=0))
    with fpp.use_rules(RULES):
        batch = {k: v.data for k, v in local_batch(make_batch(CFG, 4, 16), MESH, RULES).items()}
    with capture_graphs() as graphs:
        state, m = step(state, batch)
    nodes = list(graphs[0].nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    first_bwd = next(i for i, n in enumerate(nodes) if is_backward_node(n))

    def reader(launch):          # the first matmul reading the gathered weight
        seen, todo = set(), [launch]
        while todo:
            n = todo.pop()
            for u in n.users:
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
        return min((pos[u] for u in seen if _compute(u)), default=None)
    gathers = [n for n in nodes if _is_launch(n) and "all_gather" in n.target.__name__
               and REGATHER in (n.meta.get("custom") or {})]
    prefetch = [(pos[cur], reader(prev), pos[prev] < first_bwd)
                for prev, cur in zip(gathers, gathers[1:]) if (pos[prev] < first_bwd) == (pos[cur] < first_bwd)]
    scatters = []
    for n in nodes:
        if _is_launch(n) and "reduce_scatter" in n.target.__name__:
            wait = next(u for u in n.users if _is_wait(u))
            scatters.append((pos[n], pos[wait], sum(_compute(x) for x in nodes[pos[n]:pos[wait]])))
    return prefetch, scatters, m["loss"]


@pytest.mark.slow
def test_compiled_fsdp_prefetches_gathers_and_overlaps_reduce_scatters():
    results = fpp.launch(_order_facts, MESH, processes=True, timeout=2400)   # two compilations on a busy machine
    for prefetch, scatters, loss in results:
        fwd = [p for p in prefetch if p[2]]
        bwd = [p for p in prefetch if not p[2]]
        assert len(fwd) >= 4 * CFG.layers and len(bwd) >= 4 * CFG.layers
        for launch, previous_reader, _ in prefetch:
            assert previous_reader is not None and launch < previous_reader
        assert len(scatters) >= 4 * CFG.layers
        # all but the last layers' gradients are reduced while later backward matmuls run
        assert sum(between > 0 for _, _, between in scatters) >= len(scatters) - 3
    assert results[0][2] == results[1][2]
