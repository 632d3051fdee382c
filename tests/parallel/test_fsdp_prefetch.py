"""FSDP forward prefetch (functional_pp/parallel/fsdp/units.py, parallel/fsdp/order.py; docs/communication.md):
from the second forward on, unit k+1's flat all-gather is launched before unit k computes;
results are bitwise those of the step without prefetch, on simulated devices and on two gloo
processes, also when the model calls its layers in another order than the last forward."""
import functools

import pytest
import torch
from harness import local_batch, make_batch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.parallel.fsdp.order import trace_units

CFG = llama.Config.tiny(layers=3)
DATA = [make_batch(CFG, batch=4, seq=16, seed=i) for i in range(3)]
MESH, RULES = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)


def _permuted_loss(params, batch, orders, calls):
    """llama.loss with the layers called in ``orders[i]`` on this device's i-th call."""
    rank = fpp.current_rank()
    i = calls[rank] = calls.get(rank, -1) + 1
    order = orders[min(i, len(orders) - 1)]
    return llama.loss({**params, "layers": [params["layers"][j] for j in order]}, batch, CFG)


def _run(prefetch, orders=((0, 1, 2),), **kw):
    """A launchable function: three AdamW steps; per device the losses, the parameters, the
    collectives of every step and the unit events of every step."""
    loss = functools.partial(_permuted_loss, orders=orders, calls={})
    step = fpp.train_step(loss, fpp.optim.adamw(1e-2), mesh=MESH, rules=RULES, fsdp_prefetch=prefetch, **kw)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float64, mesh=MESH, rules=RULES, seed=0))
        losses, comms, traces = [], [], []
        for b in DATA:
            with fpp.use_rules(RULES):
                local = {k: v.data for k, v in local_batch(b, MESH, RULES).items()}
            with fpp.comm_report() as rep, trace_units() as events:
                state, m = step(state, local)
            losses.append(m["loss"])
            comms.append([(e.kind, e.shape, e.backward, e.bytes_sent) for e in rep.events])
            traces.append(list(events))
        return losses, {p: x.clone() for p, x in fpp.leaves_with_paths(state["params"])}, comms, traces
    return device


def _assert_same(a, b):
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for path in a[1]:
        assert torch.equal(a[1][path], b[1][path]), path


def _assert_prefetched(events, layers):
    """Unit k+1's gather launched before unit k computes, awaited after it started."""
    at = {e: i for i, e in enumerate(events)}
    for k in range(layers - 1):
        assert at[("launch", k + 1)] < at[("compute", k)] < at[("wait", k + 1)], events


def _assert_not_prefetched(events, layers):
    at = {e: i for i, e in enumerate(events)}
    for k in range(layers - 1):
        assert at[("compute", k)] < at[("launch", k + 1)], events


def test_forward_prefetch_on_simulated_devices_is_bitwise_and_issued_early():
    on = fpp.launch(_run(True), MESH)
    off = fpp.launch(_run(False), MESH)
    for a, b in zip(on, off):
        _assert_same(a, b)
        # the same collectives and bytes each step (in another order)
        assert [sorted(c, key=repr) for c in a[2]] == [sorted(c, key=repr) for c in b[2]]
        _assert_not_prefetched(a[3][0], CFG.layers)     # the first forward records the order
        for events in a[3][1:]:
            _assert_prefetched(events, CFG.layers)
        for events in b[3]:
            _assert_not_prefetched(events, CFG.layers)


def test_a_forward_that_changes_its_layer_order_wastes_the_prefetch_not_the_result():
    orders = [(0, 1, 2), (0, 2, 1), (0, 2, 1)]
    on = fpp.launch(_run(True, orders), MESH)
    off = fpp.launch(_run(False, orders), MESH)
    for a, b in zip(on, off):
        _assert_same(a, b)
        # step 2 calls layer 2 where step 1 called layer 1, then layer 1 where it called layer 2:
        # both prefetches are dropped (awaited, unused) and each layer gathered when called
        gathers = [[c for c in comm if c[0] == "all_gather" and not c[2]] for comm in a[2]]
        assert len(gathers[1]) == len(gathers[0]) + 2 and len(gathers[2]) == len(gathers[0])
        _assert_prefetched(a[3][2], CFG.layers)         # step 3 replays step 2's order


def _gloo(prefetch, **kw):
    losses, params, _, traces = _run(prefetch, **kw)()
    return losses, {p: x.numpy() for p, x in params.items()}, traces


@pytest.fixture(scope="module")
def gloo_on_off():
    """The same FSDP steps on 2 gloo processes with prefetch on and off (run once for the
    tests below)."""
    on = fpp.launch(functools.partial(_gloo, True), MESH, processes=True, timeout=300)
    off = fpp.launch(functools.partial(_gloo, False), MESH, processes=True, timeout=300)
    for (l1, p1, _), (l0, p0, _) in zip(on, off):
        assert l1 == l0
        for path in p0:
            assert (p1[path] == p0[path]).all(), path
    return on, off


@pytest.mark.multiprocess
@pytest.mark.slow
def test_forward_prefetch_on_gloo_processes(gloo_on_off):
    on, off = gloo_on_off
    for (_, _, t1), (_, _, t0) in zip(on, off):
        for events in t1[1:]:
            _assert_prefetched(events, CFG.layers)
        for events in t0:
            _assert_not_prefetched(events, CFG.layers)


def _assert_reduce_scatter_overlapped(events, layers):
    """Unit k's gradient reduce-scatter issued before unit k-1's backward needs its weights,
    and awaited only after that backward started (asynchronous, overlapped), and before unit
    k-2's is issued (one in flight at a time, as FSDP2)."""
    at = {e: i for i, e in enumerate(events)}
    for k in range(1, layers):
        assert at[("reduce_scatter", k)] < at[("backward", k - 1)] < at[("reduce_scatter_wait", k)], events
        if k >= 2:
            assert at[("reduce_scatter_wait", k)] < at[("reduce_scatter", k - 2)], events


@pytest.mark.multiprocess
@pytest.mark.slow
def test_backward_reduce_scatter_is_asynchronous_on_gloo_processes(gloo_on_off):
    """With prefetch, each unit's flat reduce-scatter is launched when backward produces its
    gradients and overlaps the previous unit's backward; without, it is waited at once."""
    on, off = gloo_on_off
    for (_, _, t1), (_, _, t0) in zip(on, off):
        for events in t1:
            _assert_reduce_scatter_overlapped(events, CFG.layers)
        for events in t0:
            assert ("backward", 0) in events and not any(e[0].startswith("reduce_scatter") for e in events)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_in_flight_bound_governs_eager_reduce_scatters_on_gloo_processes(gloo_on_off):
    """The policy's ``collectives_in_flight`` bounds eager units' reduce-scatters as it bounds
    compiled graphs' (docs/communication.md): with 1, each is awaited right after its launch, before
    the previous unit's backward; with 3, unit k's waits until unit k-2's is launched. The
    numbers stay bitwise those of the default run."""
    on, _ = gloo_on_off
    for limit in (1, 3):
        bounded = fpp.launch(functools.partial(_gloo, True, collectives_in_flight=limit), MESH, processes=True,
                             timeout=300)
        for (l1, p1, _), (lb, pb, tb) in zip(on, bounded):
            assert lb == l1
            for path in p1:
                assert (pb[path] == p1[path]).all(), path
            for events in tb:
                at = {e: i for i, e in enumerate(events)}
                for k in range(1, CFG.layers):
                    if limit == 1:
                        assert at[("reduce_scatter", k)] < at[("reduce_scatter_wait", k)] < at[("backward", k - 1)], events
                    elif k >= 2:
                        assert at[("reduce_scatter", k - 2)] < at[("reduce_scatter_wait", k)], events


@pytest.mark.multiprocess
@pytest.mark.slow
def test_asynchronous_reduce_scatter_without_buckets_in_bf16_on_gloo_processes():
    """The unit gradients still in flight are awaited before the optimizer also without DP
    buckets (``bucket_mb=None``); 16-bit gradients are summed in fp32 as before."""
    kw = dict(bucket_mb=None, precision="bf16")
    on = fpp.launch(functools.partial(_gloo, True, **kw), MESH, processes=True, timeout=300)
    off = fpp.launch(functools.partial(_gloo, False, **kw), MESH, processes=True, timeout=300)
    for (l1, p1, t1), (l0, p0, t0) in zip(on, off):
        assert l1 == l0
        for path in p0:
            assert (p1[path] == p0[path]).all(), path
        assert ("reduce_scatter", 2) in t1[-1]


def test_forward_prefetch_with_accumulation_remat_and_hsdp_is_bitwise():
    """Micro-batches replay the previous micro-batch's order; remat's recomputation in
    backward gathers without prefetching; HSDP's replicate sums are unchanged."""
    from harness import assert_same_run, train_steps
    data = DATA[:2]
    for mesh, kw in [(MESH, dict(grad_accum=2, remat=True)), (fpp.Mesh(dp_replicate=2, dp_shard=2), {})]:
        on = fpp.launch(train_steps(CFG, data, mesh, RULES, fsdp_prefetch=True, **kw), mesh)
        off = fpp.launch(train_steps(CFG, data, mesh, RULES, fsdp_prefetch=False, **kw), mesh)
        for a, b in zip(on, off):
            assert_same_run(a, b)
            assert sorted(map(repr, a[2])) == sorted(map(repr, b[2]))
