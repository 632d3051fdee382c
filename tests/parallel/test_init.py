"""fpp.init: tile-wise generated values (docs/init.md) are mesh-independent (every shard is the
slice of the single-device init, also where shards start or end inside a tile), reproducible,
distinct across seeds/paths/tiles, and have the declared distribution."""
import math
import sys

import pytest
import torch

import functional_pp as fpp
from functional_pp.core.layout import block_slices
from functional_pp.parallel.init import TILE

T = TILE
DECLS = {
    "long": fpp.param((3 * T + 124,), "a"),                       # several tiles, short last tile
    "rows": fpp.param((6, T // 2 + 6), "b c"),                    # rows straddle tile borders
    "cube": fpp.param((4, 10, T // 8), "b d c", init="uniform", scale=0.5),
    "small": fpp.param((4, 6), "b c", scale=1.0),
    "norm": fpp.param((6,), "b", init="ones"),
}
CASES = [
    (fpp.Mesh(dp_shard=2), fpp.Rules(a="dp_shard", b="dp_shard")),           # outer splits
    (fpp.Mesh(tp=2), fpp.Rules(a="tp", c="tp")),                              # inner splits
    (fpp.Mesh(dp_shard=2, tp=2), fpp.Rules(b="dp_shard", c="tp", d="tp", a=("dp_shard", "tp"))),
]


@pytest.fixture(scope="module")
def full():
    return fpp.init_params(DECLS, seed=7)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_shard_is_the_slice_of_the_single_device_init(full, case):
    mesh, rules = CASES[case]
    for rank in range(mesh.size):
        local = fpp.init_params(DECLS, seed=7, mesh=mesh, rules=rules, rank=rank)
        for path, d in fpp.leaves_with_paths(DECLS):
            slices = block_slices(d.shape, rules.resolve(d.dims, d.shape, mesh), mesh, rank)
            got = dict(fpp.leaves_with_paths(local))[path]
            want = dict(fpp.leaves_with_paths(full))[path][slices]
            assert torch.equal(got, want), (case, rank, path)
            assert got.is_contiguous()


def test_seeds_reproduce_and_seeds_paths_and_tiles_differ(full):
    again = fpp.init_params(DECLS, seed=7)
    for (p, a), (_, b) in zip(fpp.leaves_with_paths(full), fpp.leaves_with_paths(again)):
        assert torch.equal(a, b), p
    other = fpp.init_params(DECLS, seed=8)
    assert not torch.equal(other["long"], full["long"])
    tiles = full["long"][:3 * T].reshape(3, T)
    for i in range(3):                    # tiles are independent draws, not copies of one stream
        for j in range(i + 1, 3):
            assert abs(torch.corrcoef(tiles[[i, j]])[0, 1].item()) < 0.02
    renamed = fpp.init_params({"long2": DECLS["long"]}, seed=7)["long2"]
    assert abs(torch.corrcoef(torch.stack([renamed, full["long"]]))[0, 1].item()) < 0.02


def test_values_are_pinned_for_this_generator():
    """Changing the generator (or torch changing its CPU normal/uniform draws) changes every
    model's initial weights: this pin says so. Update it only on purpose (docs/init.md)."""
    got = fpp.init_params({"w": fpp.param((2, 3), "a b", scale=1.0),
                           "u": fpp.param((3,), "a", init="uniform", scale=1.0)}, seed=0)
    torch.testing.assert_close(got["w"], torch.tensor([[1.462193, 0.196076, -0.537150],
                                                       [-1.785950, 0.575233, -1.444587]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(got["u"], torch.tensor([0.718286, 0.303021, -0.782828]), rtol=0, atol=1e-6)



def test_a_tile_depends_on_all_64_bits_of_its_hash():
    """torch's ``manual_seed`` keeps 32 bits; a tile's generator state comes from the whole
    64-bit hash, so two tiles whose hashes differ only in the high half differ (an 8 B model
    has ~120 k tiles: with 32-bit seeds two would likely be equal)."""
    init_module = sys.modules["functional_pp.parallel.init"]
    gen, decl = torch.Generator(), fpp.param((4096,), "a")
    a, b, again = torch.empty(4096), torch.empty(4096), torch.empty(4096)
    h = 0x1234_5678_9ABC_DEF0
    init_module._fill_tile(a, gen, h, decl)
    init_module._fill_tile(b, gen, h ^ (1 << 50), decl)
    init_module._fill_tile(again, gen, h, decl)
    assert torch.equal(a, again)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.1


def _ks_statistic(x: torch.Tensor, cdf) -> float:
    x, _ = torch.sort(x.double())
    n = x.numel()
    c = cdf(x)
    hi = torch.arange(1, n + 1, dtype=torch.float64) / n
    return max((hi - c).max().item(), (c - (hi - 1 / n)).max().item())


def test_normal_and_uniform_have_the_declared_distribution():
    n = 4 * T + 1000
    z = fpp.init_params({"w": fpp.param((n,), "a", scale=0.02)}, seed=1)["w"].double()
    assert abs(z.mean().item()) < 5 * 0.02 / math.sqrt(n)
    assert abs(z.std().item() / 0.02 - 1) < 0.01
    kurtosis = ((z / z.std()) ** 4).mean().item()
    assert abs(kurtosis - 3) < 0.1
    normal_cdf = lambda x: 0.5 * (1 + torch.erf(x / (0.02 * math.sqrt(2))))  # noqa: E731
    assert _ks_statistic(z, normal_cdf) < 1.63 / math.sqrt(n)          # KS at the 1% level

    u = fpp.init_params({"u": fpp.param((n,), "a", init="uniform", scale=0.5)}, seed=1)["u"].double()
    assert u.min().item() >= -0.5 and u.max().item() < 0.5
    assert abs(u.var().item() / (0.25 / 3) - 1) < 0.02
    assert _ks_statistic(u, lambda x: (x + 0.5).clamp(0, 1)) < 1.63 / math.sqrt(n)


def test_other_dtypes_hold_the_float32_values():
    base = fpp.init_params({"w": fpp.param((5, 7), "a b")}, seed=3)["w"]
    for dtype in (torch.float64, torch.bfloat16):
        got = fpp.init_params({"w": fpp.param((5, 7), "a b", dtype=dtype)}, seed=3)["w"]
        assert got.dtype == dtype and torch.equal(got, base.to(dtype))


@pytest.mark.parametrize("dims, rules", [("a b", fpp.Rules(b="tp")), ("a b", fpp.Rules(a="tp")),
                                         ("a h d", fpp.Rules(h="tp")), ("h d a", fpp.Rules(a="tp"))])
def test_a_shard_generates_only_the_tiles_it_keeps(monkeypatch, dims, rules):
    """A shard that splits any dim up to 8 ways starts and ends on tile borders, so its device
    draws no element it does not keep (row-major tiles made an inner split draw every row)."""
    init_module = sys.modules["functional_pp.parallel.init"]    # the package's `init` is the function
    drawn = []
    real = init_module._fill_tile
    monkeypatch.setattr(init_module, "_fill_tile",
                        lambda out, *a: (drawn.append(out.numel()), real(out, *a))[1])
    shape = {"a b": (512, 2048), "a h d": (512, 32, 64), "h d a": (32, 64, 512)}[dims]
    decls = {"w": fpp.param(shape, dims)}
    mesh = fpp.Mesh(tp=8)
    whole = fpp.init_params(decls, seed=3)["w"]
    for rank in (0, 5):
        drawn.clear()
        local = fpp.init_params(decls, seed=3, mesh=mesh, rules=rules, rank=rank)["w"]
        assert sum(drawn) == local.numel() == whole.numel() // 8
        slices = block_slices(shape, rules.resolve(decls["w"].dims, shape, mesh), mesh, rank)
        assert torch.equal(local, whole[slices])
