"""Every collective on simulated meshes against a numpy reference, and its gradient against
the single-device equivalent."""
import numpy as np
import pytest
import torch

import functional_pp as fpp

MESHES = {
    "2": dict(dp_shard=2),
    "4": dict(tp=4),
    "8": dict(dp_replicate=8),
    "16": dict(cp=16),
    "2x2x2": dict(dp_shard=2, cp=2, tp=2),
    "2x2x2x2": dict(dp_replicate=2, dp_shard=2, cp=2, tp=2),
}


def axis_choices(mesh):
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    choices = [(a,) for a in axes]
    if len(axes) >= 2:
        choices += [tuple(axes[:2]), tuple(reversed(axes[-2:])), tuple(axes)]
    return choices


def local_input(rank, shape=(4, 6)):
    return np.random.default_rng(rank).standard_normal(shape)


@pytest.mark.parametrize("name", list(MESHES))
def test_collectives_match_numpy(name):
    mesh = fpp.Mesh(**MESHES[name])
    for axes in axis_choices(mesh):
        n = mesh.axis_size(axes)
        shape = (2 * n, 3)

        def fn():
            x = torch.from_numpy(local_input(fpp.current_rank(), shape))
            return dict(
                psum=fpp.psum(x, axes), pmax=fpp.pmax(x, axes), pmean=fpp.pmean(x, axes),
                gather=fpp.all_gather(x, axes, axis=1), gather_t=fpp.all_gather(x, axes, axis=0, tiled=True),
                scatter=fpp.psum_scatter(x, axes, scatter_dimension=0, tiled=True),
                shift=fpp.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)]),
                a2a=fpp.all_to_all(x, axes, split_axis=0, concat_axis=1, tiled=True),
                index=fpp.axis_index(axes), size=fpp.axis_size(axes))

        results = fpp.launch(fn, mesh)
        for r, out in enumerate(results):
            group = mesh.group(r, axes)
            i = group.index(r)
            xs = [local_input(g, shape) for g in group]
            total = sum(xs[1:], xs[0].copy())
            np.testing.assert_allclose(out["psum"].numpy(), total, rtol=1e-12)
            np.testing.assert_allclose(out["pmean"].numpy(), total / n, rtol=1e-12)
            np.testing.assert_array_equal(out["pmax"].numpy(), np.max(xs, axis=0))
            np.testing.assert_array_equal(out["gather"].numpy(), np.stack(xs, axis=1))
            np.testing.assert_array_equal(out["gather_t"].numpy(), np.concatenate(xs, axis=0))
            np.testing.assert_allclose(out["scatter"].numpy(), np.split(total, n, axis=0)[i], rtol=1e-12)
            np.testing.assert_array_equal(out["shift"].numpy(), xs[(i - 1) % n])
            np.testing.assert_array_equal(out["a2a"].numpy(),
                                          np.concatenate([np.split(x, n, axis=0)[i] for x in xs], axis=1))
            assert out["index"] == i and out["size"] == n
            # psum results are bitwise identical on every device of the group
            assert torch.equal(out["psum"], results[group[0]]["psum"])


def test_nontiled_gather_scatter_roundtrip_and_partial_permute():
    mesh = fpp.Mesh(tp=4)

    def fn():
        x = torch.arange(4.0) + 10 * fpp.axis_index("tp")
        s = fpp.psum_scatter(x, "tp")                       # dim 0 of size 4 removed
        p = fpp.ppermute(x, "tp", [(0, 3)])                 # only device 3 receives
        return s, p
    for r, (s, p) in enumerate(fpp.launch(fn, mesh)):
        assert s.shape == () and s.item() == r * 4 + 60
        assert torch.equal(p, torch.arange(4.0) if r == 3 else torch.zeros(4))


def test_collective_errors_name_the_problem():
    mesh = fpp.Mesh(tp=4)
    with pytest.raises(fpp.DeviceError, match=r"unknown mesh axis 'dp'.*Did you mean 'cp'|unknown mesh axis 'dp'"):
        fpp.launch(lambda: fpp.psum(torch.ones(2), "dp"), mesh)
    with pytest.raises(fpp.DeviceError, match="needs dimension 0 of size 4, got 3"):
        fpp.launch(lambda: fpp.psum_scatter(torch.ones(3), "tp"), mesh)
    with pytest.raises(fpp.DeviceError, match="distinct indices"):
        fpp.launch(lambda: fpp.ppermute(torch.ones(2), "tp", [(0, 1), (1, 1)]), mesh)
    with pytest.raises(RuntimeError, match="must run inside functional_pp.launch"):
        fpp.psum(torch.ones(2), "tp")


def test_failure_on_one_device_stops_all_without_hanging():
    mesh = fpp.Mesh(dp_shard=2, tp=2)

    def fn():
        if fpp.current_rank() == 3:
            raise ValueError("boom on purpose")
        return fpp.psum(torch.ones(1), ("dp_shard", "tp"))   # the others wait here
    with pytest.raises(fpp.DeviceError, match=r"device 3 \(dp_replicate=0, dp_shard=1, cp=0, tp=1\) failed: "
                                              r"ValueError: boom on purpose") as info:
        fpp.launch(fn, mesh, timeout=30)
    assert info.value.rank == 3


def test_mismatched_collectives_are_reported():
    mesh = fpp.Mesh(tp=2)

    def fn():
        x = torch.ones(2 + fpp.axis_index("tp"))
        return fpp.psum(x, "tp")
    with pytest.raises(fpp.DeviceError, match=r"devices disagree on collective #0.*rank 0: \('all_reduce_sum', \(2,\)"):
        fpp.launch(fn, mesh)


# ------------------------------------------------------------------------ gradients
def _grads_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mesh_kw", [dict(dp_shard=2), dict(dp_replicate=2, dp_shard=4)])
def test_grad_data_parallel_loss_with_pvary(mesh_kw):
    mesh = fpp.Mesh(**mesh_kw)
    X, w = torch.randn(16, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    axes = tuple(a for a in ("dp_replicate", "dp_shard") if mesh.shape[a] > 1)

    def loss_fn(x, w):
        return ((x @ w) ** 2).sum() / 16

    w0 = w.clone().requires_grad_()
    loss_fn(X, w0).backward()

    def device_loss(x_local, w):
        return fpp.psum(loss_fn(x_local, fpp.pvary(w, axes)), axes)

    def fn():
        wd = w.clone().requires_grad_()
        loss = fpp.shard_map(device_loss, in_specs=(fpp.P(axes), fpp.P()), out_specs=fpp.P())(X, wd)
        loss.backward()
        return loss, wd.grad
    for loss, g in fpp.launch(fn, mesh):
        _grads_close(loss, loss_fn(X, w))
        _grads_close(g, w0.grad)


def test_grad_without_pvary_is_inserted_as_in_jax():
    """Without pvary a replicated weight meeting sharded data is cast by the matmul (JAX's
    check_vma=True); untyped (check_vma=False) the gradient stays unreduced: the oracle
    catches it."""
    mesh = fpp.Mesh(dp_shard=2)
    X, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    w0 = w.clone().requires_grad_()
    (X @ w0).sum().backward()

    def fn(check_vma):
        wd = w.clone().requires_grad_()
        f = fpp.shard_map(lambda x, w: fpp.psum((x @ w).sum(), "dp_shard"), (fpp.P("dp_shard"), fpp.P()), fpp.P(),
                          check_vma=check_vma)
        f(X, wd).backward()
        return wd.grad
    for g in fpp.launch(lambda: fn(True), mesh):
        _grads_close(g, w0.grad)
    grads = fpp.launch(lambda: fn(False), mesh)
    assert not torch.allclose(grads[0], w0.grad)


def test_grad_row_parallel_matmul_with_psum():
    mesh = fpp.Mesh(tp=4)
    X, W = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    X0, W0 = X.clone().requires_grad_(), W.clone().requires_grad_()
    ((X0 @ W0).tanh() ** 2).sum().backward()

    def fn():
        x, w = X.clone().requires_grad_(), W.clone().requires_grad_()
        f = fpp.shard_map(lambda x, w: fpp.psum(x @ w, "tp"), (fpp.P(None, "tp"), fpp.P("tp")), fpp.P())
        (f(x, w).tanh() ** 2).sum().backward()
        return x.grad, w.grad
    for gx, gw in fpp.launch(fn, mesh):
        _grads_close(gx, X0.grad)
        _grads_close(gw, W0.grad)


def test_grad_all_gathered_weight_arrives_reduce_scattered():
    mesh = fpp.Mesh(dp_shard=4)
    X, W = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    W0 = W.clone().requires_grad_()
    ((X @ W0) ** 2).sum().backward()

    def device(x_local, w_local):
        w_full = fpp.all_gather(w_local, "dp_shard", axis=0, tiled=True)   # FSDP gather
        return fpp.psum(((x_local @ w_full) ** 2).sum(), "dp_shard")

    def fn():
        w = W.clone().requires_grad_()
        with fpp.comm_report() as rep:
            fpp.shard_map(device, (fpp.P("dp_shard"), fpp.P("dp_shard")), fpp.P())(X, w).backward()
        return w.grad, rep
    for r, (g, rep) in enumerate(fpp.launch(fn, mesh)):
        _grads_close(g, W0.grad)
        assert rep.count("reduce_scatter", "dp_shard") == 1   # the FSDP gradient reduce-scatter


@pytest.mark.parametrize("which", ["ppermute", "all_to_all", "psum_scatter", "pmax", "all_gather_stacked"])
def test_grad_of_each_collective_matches_single_device(which):
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    n = 4
    A = torch.randn(16, 4, dtype=torch.float64)
    axes = ("dp_shard", "tp")

    # single-device equivalents on the global array (row blocks = devices)
    def reference(a):
        blocks = list(a.chunk(n, 0))
        if which == "ppermute":
            out = torch.cat(blocks[-1:] + blocks[:-1])
        elif which == "all_to_all":   # device i gets column block i of every row block
            out = torch.cat([torch.cat([b.chunk(n, 0)[i] for b in blocks], 1) for i in range(n)])
        elif which == "psum_scatter":
            total = sum(blocks)
            out = torch.cat([total.chunk(n, 0)[i] for i in range(n)])
        elif which == "pmax":
            out = torch.cat([torch.stack(blocks).amax(0)] * n)
        else:
            out = torch.cat([torch.stack(blocks, 1)] * n)
        return out

    def device(a_local):
        if which == "ppermute":
            return fpp.ppermute(a_local, axes, [(i, (i + 1) % n) for i in range(n)])
        if which == "all_to_all":
            return fpp.all_to_all(a_local, axes, 0, 1, tiled=True)
        if which == "psum_scatter":
            return fpp.psum_scatter(a_local, axes, scatter_dimension=0, tiled=True)
        if which == "pmax":   # invariant result returned as a block: pvary it (as JAX does)
            return fpp.pvary(fpp.pmax(a_local, axes), axes)
        return fpp.all_gather(a_local, axes, axis=1)

    A0 = A.clone().requires_grad_()
    out0 = reference(A0)
    weight = torch.randn(out0.shape, dtype=torch.float64)
    (out0 * weight).sum().backward()

    def fn():
        a = A.clone().requires_grad_()
        spec = fpp.P(axes)
        out = fpp.shard_map(device, (spec,), spec)(a)
        (out * weight).sum().backward()
        return out, a.grad
    for out, g in fpp.launch(fn, mesh):
        _grads_close(out, out0.detach())
        _grads_close(g, A0.grad)


def test_pmax_splits_the_cotangent_among_tied_devices():
    """jnp.max's rule for ties: a replicated value's pmax (implicitly pvary'd: 4 tied copies)
    has gradient 1, not 4; a maximum held by two of four devices gives each half."""
    mesh = fpp.Mesh(tp=4)

    def fn():
        x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
        fpp.shard_map(lambda a: fpp.pmax(a, "tp"), fpp.P(), fpp.P())(x).sum().backward()
        y = torch.tensor([3.0, 1.0, 3.0, 2.0], dtype=torch.float64, requires_grad=True)
        fpp.shard_map(lambda a: fpp.pmax(a, "tp"), fpp.P("tp"), fpp.P())(y).sum().backward()
        z = torch.tensor([-3.0, 1.0, -3.0, 2.0], dtype=torch.float64, requires_grad=True)
        fpp.shard_map(lambda a: fpp.pmin(a, "tp"), fpp.P("tp"), fpp.P())(z).sum().backward()
        return x.grad, y.grad, z.grad
    for gx, gy, gz in fpp.launch(fn, mesh):
        assert gx.tolist() == [1.0, 1.0]
        assert gy.tolist() == [0.5, 0.0, 0.5, 0.0] and gz.tolist() == [0.5, 0.0, 0.5, 0.0]


def test_all_to_all_untiled_has_jax_shapes_and_clear_errors():
    mesh = fpp.Mesh(tp=3)

    def fn():
        i = fpp.axis_index("tp")
        x = torch.arange(18.0).reshape(3, 6) + 100 * i        # (3, 6): split 0 of size 3
        untiled = fpp.all_to_all(x, "tp", 0, 1)                  # JAX: (6, 3)
        tiled = fpp.all_to_all(x, "tp", 0, 1, tiled=True)        # JAX: (1, 18)
        return untiled, tiled
    for r, (u, t) in enumerate(fpp.launch(fn, mesh)):
        xs = [torch.arange(18.0).reshape(3, 6) + 100 * j for j in range(3)]
        assert torch.equal(u, torch.stack([xj[r] for xj in xs], 1))
        assert torch.equal(t, torch.cat([xj[r:r + 1] for xj in xs], 1))
    with pytest.raises(fpp.DeviceError, match=r"tiled=False \(JAX's default\) needs split_axis 0 of size 3, got 4"):
        fpp.launch(lambda: fpp.all_to_all(torch.ones(4, 3), "tp", 0, 1), mesh)
    with pytest.raises(fpp.DeviceError, match=r"tiled=True: split_axis 1 has size 4, which 3 does not divide"):
        fpp.launch(lambda: fpp.all_to_all(torch.ones(3, 4), "tp", 1, 0, tiled=True), mesh)
