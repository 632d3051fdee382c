import pytest
import torch

import functional_pp as fpp


def test_logical_specs_and_local_blocks():
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    rules = fpp.Rules(batch="dp_shard", hidden="tp")
    X = torch.arange(32.0).reshape(4, 8)

    def fn():
        seen = {}

        def body(x):
            seen["shape"] = tuple(x.shape)
            return x * 2
        out = fpp.shard_map(body, "batch hidden", "batch hidden", rules=rules)(X)
        return seen["shape"], out
    for shape, out in fpp.launch(fn, mesh):
        assert shape == (2, 4)
        assert torch.equal(out, X * 2)


def test_spec_errors_name_argument_and_sizes():
    mesh = fpp.Mesh(tp=4)
    with pytest.raises(fpp.DeviceError, match=r"argument 0.*dimension 0 has size 6, which is not divisible"):
        fpp.launch(lambda: fpp.shard_map(lambda x: x, fpp.P("tp"), fpp.P("tp"))(torch.ones(6)), mesh)
    with pytest.raises(fpp.DeviceError, match=r"spec 'batch hidden' names 2 dimensions but the tensor has 1"):
        fpp.launch(lambda: fpp.shard_map(lambda x: x, "batch hidden", fpp.P(), rules=fpp.Rules())(torch.ones(6)), mesh)
    with pytest.raises(fpp.DeviceError, match="both want mesh axis 'tp'"):
        fpp.launch(lambda: fpp.shard_map(lambda x: x, fpp.P("tp", "tp"), fpp.P())(torch.ones(4, 4)), mesh)


def test_check_rep_catches_false_replication_claim():
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    X = torch.arange(8.0)

    def fn(check, check_vma=True):
        # forgot the psum over tp: each tp device holds only a partial sum
        f = fpp.shard_map(lambda x: x.sum(), fpp.P(("dp_shard", "tp")), fpp.P(), check_rep=check,
                          check_vma=check_vma)
        return f(X)
    # typed (JAX's check_vma=True): refused before anything runs, checked or not
    for check in (True, False):
        with pytest.raises(fpp.DeviceError, match=r"output\[0\] is declared replicated over mesh axis "
                                                  r"'dp_shard' \(out_specs P\(\)\) but varies over it"):
            fpp.launch(lambda: fn(check), mesh)
    # untyped: the run-time check compares the devices' values
    with pytest.raises(fpp.DeviceError, match=r"output\[0\] is declared replicated over mesh axis 'dp_shard'"):
        fpp.launch(lambda: fn(True, check_vma=False), mesh)
    fpp.launch(lambda: fn(False, check_vma=False), mesh)   # unchecked: silently per-device values
    fpp.launch(lambda: fn(None, check_vma=False), mesh)    # None: the ambient policy's check_rep (off)

    def checked_by_policy():
        with fpp.configure(check_rep=True):
            return fn(None, check_vma=False)
    with pytest.raises(fpp.DeviceError, match=r"output\[0\] is declared replicated over mesh axis 'dp_shard'"):
        fpp.launch(checked_by_policy, mesh)
    ok = fpp.shard_map(lambda x: fpp.psum(x.sum(), ("dp_shard", "tp")), fpp.P(("dp_shard", "tp")), fpp.P(),
                       check_rep=True)
    assert all(v.item() == 28 for v in fpp.launch(lambda: ok(X), mesh))


def test_pytree_arguments_and_outputs():
    mesh = fpp.Mesh(dp_shard=2)
    params = {"w": torch.ones(4, 2), "b": torch.zeros(2)}

    def fn():
        f = fpp.shard_map(lambda p: {"w": p["w"] * 3, "b": p["b"] + 1},
                          ({"w": fpp.P("dp_shard"), "b": None},), {"w": fpp.P("dp_shard"), "b": fpp.P()})
        return f(params)
    for out in fpp.launch(fn, mesh):
        assert torch.equal(out["w"], torch.full((4, 2), 3.0)) and torch.equal(out["b"], torch.ones(2))


def _grad(f, in_specs, out_specs, X, cotangent=None, mesh=fpp.Mesh(tp=3), **kw):
    def fn():
        x = X.clone().requires_grad_()
        out = fpp.shard_map(f, in_specs, out_specs, **kw)(x)
        (out * (torch.ones_like(out) if cotangent is None else cotangent)).sum().backward()
        return out.detach(), x.grad
    return fpp.launch(fn, mesh)


X3 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)


def test_implicit_pvary_gives_jax_gradients():
    """The answers of jax.shard_map(check_vma=True) on 3 devices (docs/manual_mode.md)."""
    for out, g in _grad(lambda a: fpp.psum(a, "tp"), fpp.P(), fpp.P(), X3):    # psum of a replicated value
        assert out.tolist() == [3.0, 6.0, 9.0] and g.tolist() == [3.0, 3.0, 3.0]
    for out, g in _grad(lambda a: fpp.psum(a, "tp")[None], fpp.P("tp"), fpp.P("tp"), X3,
                        torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)):   # cast at the out_spec
        assert out.flatten().tolist() == [6.0, 6.0, 6.0] and g.tolist() == [6.0, 6.0, 6.0]
    for _, g in _grad(lambda a: fpp.psum(a * (fpp.axis_index("tp") + 1.0), "tp"), fpp.P(), fpp.P(), X3):
        assert g.tolist() == [6.0, 6.0, 6.0]                  # axis_index varies: 1 + 2 + 3
    for _, g in _grad(lambda a: fpp.all_gather(a, "tp"), fpp.P(), fpp.P("tp"), X3):
        assert g.tolist() == [9.0, 9.0, 9.0]                  # all_gather of a replicated value
    # the explicit style gives the same bits, typed or untyped
    explicit = lambda a: fpp.psum(fpp.pvary(a, "tp"), "tp")      # noqa: E731
    typed = _grad(explicit, fpp.P(), fpp.P(), X3)
    untyped = _grad(explicit, fpp.P(), fpp.P(), X3, check_vma=False)
    implicit = _grad(lambda a: fpp.psum(a, "tp"), fpp.P(), fpp.P(), X3)
    for (o1, g1), (o2, g2), (o3, g3) in zip(typed, untyped, implicit):
        assert torch.equal(o1, o2) and torch.equal(g1, g2) and torch.equal(o1, o3) and torch.equal(g1, g3)
    # untyped, a missing pvary is the caller's: the old, unreduced gradient
    for _, g in _grad(lambda a: fpp.psum(a, "tp"), fpp.P(), fpp.P(), X3, check_vma=False):
        assert g.tolist() == [1.0, 1.0, 1.0]


def test_binary_ops_cast_an_invariant_operand():
    mesh = fpp.Mesh(dp_shard=2, tp=3)
    X, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    w0 = w.clone().requires_grad_()
    (torch.tanh(X @ w0) * w0.sum()).sum().backward()

    def fn():
        wd = w.clone().requires_grad_()
        f = fpp.shard_map(lambda x, w: fpp.psum((torch.tanh(x @ w) * w.sum()).sum(), ("dp_shard", "tp")),
                          (fpp.P(("dp_shard", "tp")), fpp.P()), fpp.P())
        f(X, wd).backward()
        return wd.grad
    for g in fpp.launch(fn, mesh):
        torch.testing.assert_close(g, w0.grad, rtol=1e-10, atol=1e-12)


def test_ambiguous_programs_are_refused_naming_value_axis_and_fix():
    mesh = fpp.Mesh(dp_shard=2, tp=3)
    X = torch.ones(6, 6)

    def run(f, spec=fpp.P("dp_shard"), out=fpp.P()):
        return fpp.launch(lambda: fpp.shard_map(f, spec, out)(X), mesh)
    with pytest.raises(fpp.DeviceError, match=r"pvary: a float32 tensor of shape \(3, 6\) \(argument 0\) already "
                                              r"varies over mesh axis 'dp_shard'.*drop this pvary"):
        run(lambda x: fpp.psum(fpp.pvary(x, "dp_shard"), "dp_shard"))
    with pytest.raises(fpp.DeviceError, match=r"psum: .*varies over mesh axis 'dp_shard' but is invariant over "
                                              r"'tp'.*functional_pp.pvary\(x, \('tp',\)\)"):
        run(lambda x: fpp.psum(x, ("dp_shard", "tp")))
    with pytest.raises(fpp.DeviceError, match=r"in-place add_ writes a value varying over mesh axis 'dp_shard' "
                                              r"into .*invariant over it.*pvary"):
        run(lambda x: fpp.psum(torch.zeros(3, 6).add_(x), "dp_shard"))
    with pytest.raises(fpp.DeviceError, match=r"output\[0\] is declared replicated over mesh axis 'dp_shard' "
                                              r"\(out_specs P\(\)\) but varies over it: .*the result of tanh"):
        run(lambda x: torch.tanh(x))
    with pytest.raises(fpp.DeviceError, match=r"split_invariant: .*varies over mesh axis 'dp_shard'.*slice_varying"):
        run(lambda x: fpp.parallel.collectives.split_invariant(x, "dp_shard", 1), out=fpp.P("dp_shard"))
    # the fixes run
    run(lambda x: fpp.psum(fpp.pvary(x, "tp"), ("dp_shard", "tp")))
    run(lambda x: fpp.psum(fpp.pvary(torch.zeros(3, 6), "dp_shard").add_(x), "dp_shard"))


def test_nested_typed_shard_map_and_out_arguments():
    mesh = fpp.Mesh(tp=3)
    inner = fpp.shard_map(lambda a: a, fpp.P(), fpp.P())
    with pytest.raises(fpp.DeviceError, match=r"shard_map inside the body of a shard_map with check_vma=True"):
        fpp.launch(lambda: fpp.shard_map(lambda a: inner(a), fpp.P(), fpp.P())(X3), mesh)

    def out_arg(x):
        buf = torch.empty(1, dtype=torch.float64)
        return torch.add(torch.zeros(1, dtype=torch.float64), x, out=buf)     # buf: invariant
    with pytest.raises(fpp.DeviceError, match=r"in-place add writes a value varying over mesh axis 'tp' into "
                                              r"a float64 tensor of shape \(1,\)"):
        fpp.launch(lambda: fpp.shard_map(out_arg, fpp.P("tp"), fpp.P("tp"))(X3), mesh)
