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
