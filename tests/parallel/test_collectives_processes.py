"""Every collective on real gloo processes (the torch.distributed backend) equals the simulated
backend bit for bit, with the shapes ops really send: multi-dimensional tensors, every
dimension, tuples of mesh axes in both orders (groups whose order is not torch's ascending
one), non-contiguous inputs, bf16, partial permutations; forward values and gradients, eager
and under torch.compile(fullgraph=True).

Values are small integers, so every sum is exact whatever order a backend adds in: any
difference is a routing error, never rounding."""
import numpy as np
import pytest
import torch

import functional_pp as fpp
from functional_pp.parallel import collectives as C

pytestmark = pytest.mark.multiprocess

MESH = fpp.Mesh(dp_shard=2, tp=2)
AXES = ["tp", "dp_shard", ("dp_shard", "tp"), ("tp", "dp_shard")]
DTYPES = [torch.float64, torch.bfloat16]


VIEWS = {"contig": lambda t: t, "transposed": lambda t: t.transpose(0, 2), "strided": lambda t: t[:, ::2]}


def _base(dtype):
    """This device's (4, 8, 12) block of small integers."""
    return (torch.arange(4 * 8 * 12).reshape(4, 8, 12) % 7 + fpp.current_rank()).to(dtype)


def _cases(n):
    """(name, dimension that must split n ways or None, fn(x, axes)) for every collective
    and argument the ops use."""
    ring = [(i, (i + 1) % n) for i in range(n)]
    partial = [(0, n - 1)] + ([(n - 1, 1)] if n > 2 else [])          # some devices idle
    with_self = [(0, 0)] + ([(1, n - 1), (n - 1, 1)] if n > 2 else [])  # one keeps its own
    cases = [("psum", None, lambda x, a: fpp.psum(x, a)),
             ("pmax", None, lambda x, a: fpp.pmax(x, a)),
             ("gather_stacked", None, lambda x, a: fpp.all_gather(x, a, axis=1)),
             ("ring_next", None, lambda x, a: fpp.ppermute(x, a, ring)),
             ("ring_prev", None, lambda x, a: fpp.ppermute(x, a, [(d, s) for s, d in ring])),
             ("partial_perm", None, lambda x, a: fpp.ppermute(x, a, partial)),
             ("self_and_swap", None, lambda x, a: fpp.ppermute(x, a, with_self))]
    for d in range(3):
        cases.append((f"gather_dim{d}", None, lambda x, a, d=d: fpp.all_gather(x, a, axis=d, tiled=True)))
        cases.append((f"scatter_dim{d}", d, lambda x, a, d=d: fpp.psum_scatter(x, a, scatter_dimension=d, tiled=True)))
    # the transposes that take no collective of their own in forward (docs/collectives.md)
    cases.append(("pvary", None, lambda x, a: fpp.pvary(x, a)))
    for d in range(3):
        cases.append((f"gather_invariant_dim{d}", None,
                      lambda x, a, d=d: fpp.all_gather(x, a, axis=d, tiled=True, invariant=True)))
        cases.append((f"split_invariant_dim{d}", d, lambda x, a, d=d: C.split_invariant(x, a, d)))
        cases.append((f"slice_varying_dim{d}", d, lambda x, a, d=d: C.slice_varying(x, a, d)))
    for s, c in [(0, 1), (2, 0), (1, 1), (0, 2), (-1, -2)]:
        cases.append((f"a2a_{s}_{c}", s, lambda x, a, s=s, c=c: fpp.all_to_all(x, a, s, c, tiled=True)))
    return cases


def collective_matrix():
    """Forward value and input gradient of every case, as exact float64 arrays."""
    out = {}
    for dtype in DTYPES:
        for view, make_view in VIEWS.items():
            for axes in AXES:
                n = fpp.axis_size(axes)
                for name, split_dim, fn in _cases(n):
                    leaf = _base(dtype).requires_grad_()
                    x = make_view(leaf)            # the collective receives the view itself
                    if split_dim is not None and x.shape[split_dim] % n:
                        continue
                    y = fn(x, axes)
                    w = (torch.arange(y.numel()).reshape(y.shape) % 3 + 1).to(dtype)
                    (g,) = torch.autograd.grad((y * w).sum(), leaf)
                    out[f"{dtype}/{view}/{axes}/{name}"] = (y.detach().to(torch.float64).numpy(),
                                                           g.to(torch.float64).numpy())
    return out


def test_every_collective_on_gloo_equals_simulation_bitwise():
    real = fpp.launch(collective_matrix, MESH, processes=True, timeout=600)
    sim = fpp.launch(collective_matrix, MESH)
    assert len(real[0]) > 300                 # every case ran (2 dtypes x 3 views x 4 axes x ~20)
    for rank, (a, b) in enumerate(zip(real, sim)):
        assert a.keys() == b.keys()
        for key in a:
            for part, u, v in zip(("value", "grad"), a[key], b[key]):
                assert u.shape == v.shape and np.array_equal(u, v), f"rank {rank} {key} {part}"


def _compiled_ring_and_a2a():
    """Ring attention's pattern (ppermute of a 4-D K/V block, here a transposed view) and
    Ulysses' all_to_all, traced by torch.compile(fullgraph=True) on this backend."""
    import torch._dynamo.testing as dynamo_testing
    torch._dynamo.reset()
    n = fpp.axis_size(("dp_shard", "tp"))
    ring = [(i, (i + 1) % n) for i in range(n)]

    def f(x):
        kv = x.transpose(1, 2)                                       # batch heads seq dim
        y = fpp.ppermute(kv, ("tp", "dp_shard"), ring)
        z = fpp.all_to_all(y.to(torch.bfloat16), ("dp_shard", "tp"), 1, 2, tiled=True)
        return (y.sum(1) * 2).sum() + z.float().square().sum()

    g = torch.Generator().manual_seed(fpp.current_rank())
    x = torch.randint(-3, 4, (2, 4, 8, 5), generator=g).float().requires_grad_()
    eager = f(x)
    (ge,) = torch.autograd.grad(eager, x)
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    out = torch.compile(f, backend=counter, fullgraph=True)(x)
    (gc,) = torch.autograd.grad(out, x)
    return eager.item(), out.item(), ge.numpy(), gc.numpy(), counter.frame_count


def test_compiled_permute_and_all_to_all_on_gloo():
    real = fpp.launch(_compiled_ring_and_a2a, MESH, processes=True, timeout=300)
    sim = fpp.launch(_compiled_ring_and_a2a, MESH)
    for (e, c, ge, gc, frames), (se, _, sge, _, _) in zip(real, sim):
        assert frames == 1                                  # one graph, no breaks
        assert e == c == se
        assert np.array_equal(ge, gc) and np.array_equal(ge, sge)


def _check_rep_over_tp():
    """Replicated over dp_shard, not over tp: the check exchanges objects within each tp group
    and each dp_shard group only (sub-groups of the world)."""
    x = torch.arange(8.0)
    f = fpp.shard_map(lambda b: fpp.psum(b.sum(), "dp_shard"), fpp.P(("dp_shard", "tp")), fpp.P(),
                      check_rep=True)
    return f(x)


def test_replication_check_on_gloo_subgroups():
    with pytest.raises(fpp.DeviceError, match=r"declared replicated over mesh axis 'tp'"):
        fpp.launch(_check_rep_over_tp, MESH, processes=True, timeout=300)
    ok = fpp.shard_map(lambda b: fpp.psum(b.sum(), ("dp_shard", "tp")), fpp.P(("dp_shard", "tp")), fpp.P(),
                       check_rep=True)
    assert [v.item() for v in fpp.launch(lambda: ok(torch.arange(8.0)), MESH, processes=True, timeout=300)] == [28.0] * 4


def _implicit_pvary():
    """Manual mode as a JAX user writes it (no pvary): a replicated weight meeting sharded data
    in a matmul, the psum of a replicated value, an invariant output cast at an out_spec that
    splits it, and an all_gather of a replicated value (docs/manual_mode.md)."""
    axes = ("dp_shard", "tp")
    X = (torch.arange(24.0, dtype=torch.float64).reshape(8, 3) % 5) - 2
    w = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64, requires_grad=True)
    loss = fpp.shard_map(lambda x, w: fpp.psum(((x @ w) ** 2).sum(), axes), (fpp.P(axes), fpp.P()), fpp.P())(X, w)
    (gw,) = torch.autograd.grad(loss, w)
    v = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    out = fpp.shard_map(lambda a: fpp.psum(a, axes)[None] + fpp.all_gather(a, "tp")[:1], fpp.P(), fpp.P(axes))(v)
    cot = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape)
    (gv,) = torch.autograd.grad((out * cot).sum(), v)
    return loss.item(), gw.numpy(), out.detach().numpy(), gv.numpy()


def test_implicit_pvary_on_gloo_equals_simulation():
    real = fpp.launch(_implicit_pvary, MESH, processes=True, timeout=300)
    sim = fpp.launch(_implicit_pvary, MESH)
    X = (torch.arange(24.0, dtype=torch.float64).reshape(8, 3) % 5) - 2
    w0 = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64, requires_grad=True)
    ((X @ w0) ** 2).sum().backward()
    for a, b in zip(real, sim):
        assert a[0] == b[0] == ((X @ w0.detach()) ** 2).sum().item()
        for u, v in zip(a[1:], b[1:]):
            assert np.array_equal(u, v)
        assert np.array_equal(a[1], w0.grad.numpy())            # the pvary the matmul inserted
        # JAX's answer: the psum of 4 copies gives 4 times the summed cotangent C, the block
        # of tp index 0 that every device takes from the gather gives C once
        cot = np.arange(8.0).reshape(4, 2)
        assert np.array_equal(a[3], 5 * cot.sum(0))
