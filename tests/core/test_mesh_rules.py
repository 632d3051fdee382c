import pytest
import torch

import functional_pp as fpp
from functional_pp.core.layout import spec_to_layout
from functional_pp.parallel import sharding


def test_mesh_default_order_and_coords():
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert mesh.axis_names == ("dp_replicate", "dp_shard", "cp", "tp")
    assert mesh.size == 16
    assert mesh.coords(1) == {"dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}  # tp innermost
    assert mesh.coords(8)["dp_replicate"] == 1
    for r in range(16):
        assert mesh.rank_of(mesh.coords(r)) == r
    assert mesh.group(0, "tp") == (0, 1)
    assert mesh.group(5, ("dp_shard", "cp")) == (1, 3, 5, 7)
    assert mesh.group(5, ("cp", "dp_shard")) == (1, 5, 3, 7)  # first axis major
    assert mesh.axis_index(6, ("dp_shard", "cp")) == 3
    assert sorted(r for g in mesh.groups(("dp_shard", "tp")) for r in g) == list(range(16))


def test_mesh_extra_axes_and_from_axes():
    mesh = fpp.Mesh(tp=2, ep=4)
    assert mesh.axis_names[-1] == "ep" and mesh.size == 8
    m2 = fpp.Mesh.from_axes([("pp", 2), ("dp", 3)])
    assert m2.axis_names == ("pp", "dp") and m2.coords(4) == {"pp": 1, "dp": 1}


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_mesh_bad_size(bad):
    with pytest.raises(ValueError, match="'cp' has size"):
        fpp.Mesh(cp=bad)


def test_mesh_world_size_mismatch_names_sizes():
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    with pytest.raises(ValueError, match=r"4 devices \(.*dp_shard=2.*tp=2.*\) but the world size is 8"):
        mesh.validate_world_size(8)


def test_mesh_unknown_axis():
    mesh = fpp.Mesh(tp=2)
    with pytest.raises(ValueError, match=r"unknown mesh axis 'tpp'.*Did you mean 'tp'"):
        mesh.group(0, "tpp")


def test_rules_resolution_earlier_dims_win():
    mesh = fpp.Mesh(dp_shard=2, cp=2, tp=2)
    rules = fpp.Rules(batch=("dp_replicate", "dp_shard"), seq="cp", hidden=("dp_shard", "cp"), mlp="tp")
    # FSDP: the weight splits hidden over dp_shard x cp.
    assert rules.resolve(("hidden", "mlp"), (8, 4), mesh) == (("dp_shard", "cp"), ("tp",))
    # Activation: batch took dp_shard, seq took cp, so hidden stays whole; size-1 axes dropped.
    assert rules.resolve(("batch", "seq", "hidden"), (4, 8, 8), mesh) == (("dp_shard",), ("cp",), ())
    assert rules.resolve(("vocab",), (10,), mesh) == ((),)


def test_rules_errors():
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    with pytest.raises(ValueError, match="names mesh axis 'tp' twice"):
        fpp.Rules(heads=("tp", "tp"))
    with pytest.raises(ValueError, match=r"Rule heads=\('tpp',\).*Did you mean 'tp'"):
        fpp.Rules(heads="tpp").resolve(("heads",), (4,), mesh)
    with pytest.raises(ValueError, match=r"layers\.0\.wq: dim 'heads' has size 3.*\('tp',\)"):
        fpp.Rules(heads="tp").resolve(("hidden", "heads"), (4, 3), mesh, name="layers.0.wq")


def test_spec_errors():
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    assert spec_to_layout(fpp.P("dp_shard", None, ("tp",)), 3, mesh) == (("dp_shard",), (), ("tp",))
    with pytest.raises(ValueError, match="dimensions 'a' and 'b' both want mesh axis 'tp'"):
        spec_to_layout(fpp.P("tp", "tp"), 2, mesh, name="x", dims=("a", "b"))
    with pytest.raises(ValueError, match="unknown mesh axis 'dp'"):
        spec_to_layout(fpp.P("dp"), 1, mesh)
    with pytest.raises(ValueError, match="dimension 0 has size 3"):
        spec_to_layout(fpp.P("dp_shard"), 1, mesh, shape=(3,))


def test_param_tree_utils_and_mesh_independent_init():
    decls = {"emb": fpp.param((8, 4), "vocab hidden"),
             "layers": [{"w": fpp.param((4, 6), "hidden mlp"), "norm": fpp.param((4,), "hidden", init="ones")}]}
    assert fpp.count_params(decls) == 32 + 24 + 4
    full = fpp.init_params(decls, seed=3)
    assert [p for p, _ in fpp.leaves_with_paths(full)] == ["emb", "layers.0.norm", "layers.0.w"]
    assert abs(full["emb"].std().item() - 0.02) < 0.01 and torch.equal(full["layers"][0]["norm"], torch.ones(4))
    assert not torch.equal(fpp.init_params(decls, seed=4)["emb"], full["emb"])
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    rules = fpp.Rules(hidden="dp_shard", mlp="tp", vocab="tp")

    def run():
        local = fpp.init_params(decls, seed=3, mesh=mesh, rules=rules)
        from functional_pp.core import tree
        return local, fpp.gather_tree(local, decls, rules)

    for r, (local, gathered) in enumerate(fpp.launch(run, mesh)):
        expect = sharding.shard(full, decls, mesh, rules, r)
        for (p, a), (_, b) in zip(fpp.leaves_with_paths(local), fpp.leaves_with_paths(expect)):
            assert torch.equal(a, b), p
        for (p, a), (_, b) in zip(fpp.leaves_with_paths(gathered), fpp.leaves_with_paths(full)):
            assert torch.equal(a, b), p
    assert fpp.launch(lambda: fpp.init_params(decls, seed=3, mesh=mesh, rules=rules)["layers"][0]["w"].shape,
                      mesh)[0] == (2, 3)
