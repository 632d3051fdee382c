"""Bucketed asynchronous DP gradient all-reduce (functional_pp/parallel/buckets/): the same numbers
as the per-gradient reduction and the single device, one all-reduce event per bucket, the
analytic bytes, buckets launched during backward, and the same on real gloo processes."""
import pytest
import torch
from harness import assert_same_run, make_batch, train_steps

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.parallel.buckets.eager import grad_buckets
from functional_pp.parallel.buckets.pending import PendingGrad

CFG = llama.Config.tiny()
P = fpp.count_params(llama.init(CFG))
DATA = [make_batch(CFG, batch=8, seq=16, seed=i) for i in range(2)]


def _train(mesh, rules, dtype=torch.float64, **step_kw):
    """Two steps; per device: losses, parameters, and the first step's gradient all-reduces
    (scalars excluded) as (axes, shape, backward, bytes)."""
    run = train_steps(CFG, DATA, mesh, rules, dtype, **step_kw)

    def device():
        losses, params, events = run()
        return losses, params, [(e.axes, e.shape, e.backward, e.bytes_sent) for e in events
                                if e.kind == "all_reduce" and e.shape != ()]
    return device


_assert_equal = assert_same_run


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


DP = (fpp.Mesh(dp_replicate=2), fpp.Rules(batch="dp_replicate"))


@pytest.mark.parametrize("bucket_mb", [0, 0.05, 25])
def test_bucketed_dp_equals_unbucketed_and_one_device(bucket_mb):
    mesh, rules = DP
    one = fpp.launch(_train(fpp.Mesh(), fpp.Rules()), fpp.Mesh())[0]
    plain = fpp.launch(_train(mesh, rules, bucket_mb=None), mesh)
    bucketed = fpp.launch(_train(mesh, rules, bucket_mb=bucket_mb), mesh)
    for rank in range(2):
        _assert_equal(bucketed[rank], plain[rank])            # bitwise: the same sums
        _assert_equal(bucketed[rank], one, rtol=1e-9, atol=1e-11)
    per_grad, buckets = plain[0][2], bucketed[0][2]
    assert len(per_grad) == len(fpp.leaves_with_paths(one[1]))   # unbucketed: one per gradient
    # bytes exactly the formula 2(n-1)/n P B; every event is one bucket, each full but the last
    n, B = 2, 8
    assert sum(e[3] for e in buckets) == sum(e[3] for e in per_grad) == 2 * (n - 1) * P * B // n
    assert all(e[2] and e[0] == ("dp_replicate",) and len(e[1]) == 1 for e in buckets)
    assert sum(_numel(e[1]) for e in buckets) == P
    capacity = int(bucket_mb * 2 ** 20)
    assert all(_numel(e[1]) * B >= capacity for e in buckets[:-1])
    expected = {0: len(per_grad), 25: 1}.get(bucket_mb)
    if expected is not None:
        assert len(buckets) == expected
    else:
        assert 1 < len(buckets) < len(per_grad)


def test_hsdp_replicate_reduction_bucketed():
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2)
    rules = fpp.Rules(batch=("dp_replicate", "dp_shard"), hidden="dp_shard")
    plain = fpp.launch(_train(mesh, rules, bucket_mb=None), mesh)
    bucketed = fpp.launch(_train(mesh, rules), mesh)
    for rank in range(4):
        _assert_equal(bucketed[rank], plain[rank])
    replicate = [e for e in bucketed[0][2] if e[0] == ("dp_replicate",)]
    assert len(replicate) == 1                                     # the shards, in one bucket
    assert sum(e[3] for e in replicate) == 2 * (2 - 1) * (P // 2) * 8 // 2   # 2(r-1)/r (P/f) B


def test_mixed_precision_bucketed_equals_unbucketed():
    mesh, rules = DP
    plain = fpp.launch(_train(mesh, rules, torch.float32, bucket_mb=None, precision="bf16"), mesh)
    bucketed = fpp.launch(_train(mesh, rules, torch.float32, precision="bf16"), mesh)
    _assert_equal(bucketed[0], plain[0])
    # bf16 gradients are summed in fp32 (reduce dtype), one bucket, the cast back stays lazy
    assert [len(e[1]) for e in bucketed[0][2]] == [1]


class _Marker(torch.autograd.Function):
    """Identity; its backward calls ``probe`` (how many all-reduces were issued before it ran)."""

    @staticmethod
    def forward(x, probe):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.probe = inputs[1]

    @staticmethod
    def backward(ctx, g):
        ctx.probe()
        return g, None


def _overlap_probe(bucket_mb):
    w1 = torch.ones(256, dtype=torch.float64, requires_grad=True)
    w2 = torch.full((256,), 2.0, dtype=torch.float64, requires_grad=True)
    x = torch.arange(256, dtype=torch.float64) * (fpp.current_rank() + 1)
    seen = []
    with fpp.comm_report() as rep, grad_buckets(bucket_mb) as buckets:
        h = x * fpp.pvary(w1, "dp_replicate")
        h = _Marker.apply(h, lambda: seen.append(rep.count("all_reduce")))
        loss = (h * fpp.pvary(w2, "dp_replicate")).sum()
        grads = torch.autograd.grad(loss, [w1, w2])
        pending = [isinstance(g, PendingGrad) for g in grads]
        grads = buckets.finish(grads)
    return seen, pending, [g.numpy() for g in grads], len(rep.events)


def test_buckets_launch_during_backward():
    """w2's gradient (2 KB) fills a 1 KB bucket and is all-reduced while backward goes on, before
    w1's gradient exists; the gradients stay pending until finish, then equal the sums."""
    seen, pending, grads, events = fpp.launch(lambda: _overlap_probe(1 / 1024), DP[0])[0]
    assert seen == [1] and pending == [True, True] and events == 2
    x_sum = torch.arange(256, dtype=torch.float64) * 3          # x summed over the two ranks
    torch.testing.assert_close(torch.from_numpy(grads[0]), 2 * x_sum)
    seen, _, _, events = fpp.launch(lambda: _overlap_probe(25), DP[0])[0]
    assert seen == [0] and events == 1                           # one bucket, launched at the end


def test_reduced_gradients_are_views_of_their_bucket_and_owned_by_the_step():
    """finish hands out the reduced gradients as disjoint views of the bucket's flat buffer
    (no copy out, as DDP's gradient_as_bucket_view); own_buffers keeps them and copies only a
    gradient that overlaps another or shares memory with a parameter."""
    from functional_pp.step.buffers import own_buffers

    def views():
        w = [torch.ones(8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        x = torch.arange(8, dtype=torch.float64)
        with grad_buckets(25) as buckets:
            loss = sum((x * fpp.pvary(v, "dp_replicate")).sum() for v in w)
            grads = buckets.finish(torch.autograd.grad(loss, w))
        return [(g.untyped_storage().data_ptr(), g.storage_offset()) for g in grads]
    (p0, o0), (p1, o1) = fpp.launch(views, DP[0])[0]
    assert p0 == p1 and {o0, o1} == {0, 8}                 # one bucket, two disjoint views

    flat, param = torch.zeros(10), torch.zeros(3)
    a, b, c = flat[:4], flat[4:10], flat[2:6]
    out = own_buffers([a, b, c, param[:2], flat[4:4]], [param])
    assert out[0] is a and out[1] is b and out[4].numel() == 0
    assert out[2] is not c and out[2].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert out[3].untyped_storage().data_ptr() != param.untyped_storage().data_ptr()


def test_own_buffers_keeps_separate_gradients_and_copies_a_parameter_or_a_broadcast():
    """Gradients each in its own storage (the usual eager step) are kept as they are, without the
    per-gradient span walk; one that is a parameter's memory or not dense is still copied."""
    from functional_pp.step.buffers import own_buffers
    params = [torch.zeros(3), torch.zeros(4)]
    grads = [torch.ones(3), torch.ones(4)]
    out = own_buffers(grads, params)
    assert all(o is g for o, g in zip(out, grads))
    for bad in (params[1], torch.ones(1).expand(4)):
        out = own_buffers([grads[0], bad], params)
        assert out[0] is grads[0] and out[1] is not bad and torch.equal(out[1], bad)
        assert out[1].is_contiguous() and out[1].untyped_storage().data_ptr() != bad.untyped_storage().data_ptr()


def test_bad_bucket_size_is_refused():
    with pytest.raises(ValueError, match="bucket_mb must be a size in megabytes"):
        fpp.train_step(llama.loss, fpp.optim.adamw(1e-3), bucket_mb=-1)
    with pytest.raises(ValueError, match="bucket_mb"):
        fpp.train_step(llama.loss, fpp.optim.adamw(1e-3), bucket_mb="25")


def _gloo_variants():
    mesh, rules = DP
    return {name: _train(mesh, rules, **kw)() for name, kw in
            [("plain", dict(bucket_mb=None)), ("bucketed", dict()), ("small", dict(bucket_mb=0.05))]}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_bucketed_dp_on_gloo_processes():
    real = fpp.launch(_gloo_variants, DP[0], processes=True, timeout=300)
    one = fpp.launch(_train(fpp.Mesh(), fpp.Rules()), fpp.Mesh())[0]
    for rank, runs in enumerate(real):
        _assert_equal(runs["bucketed"], runs["plain"])        # two ranks: a + b, bitwise
        _assert_equal(runs["small"], runs["plain"])
        _assert_equal(runs["bucketed"], one, rtol=1e-9, atol=1e-11)
        assert len(runs["bucketed"][2]) == 1
        assert 1 < len(runs["small"][2]) < len(runs["plain"][2])
        assert sum(e[3] for e in runs["small"][2]) == 2 * (2 - 1) * P * 8 // 2
