"""The same collectives and gradients on real gloo processes, and torch.compile(fullgraph=True)."""
import numpy as np
import pytest
import torch

import functional_pp as fpp

pytestmark = pytest.mark.multiprocess


def collective_suite():
    rank = fpp.current_rank()
    x = (torch.arange(8.0, dtype=torch.float64) + 1) * (rank + 1)
    x.requires_grad_()
    axes = tuple(a for a in ("dp_shard", "tp") if fpp.current_mesh().shape[a] > 1)
    n = fpp.axis_size(axes)
    out = dict(
        psum=fpp.psum(x, axes), pmax=fpp.pmax(x, axes),
        gather=fpp.all_gather(x, tuple(reversed(axes)), tiled=True),
        scatter=fpp.psum_scatter(x, axes, tiled=True),
        shift=fpp.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)]),
        a2a=fpp.all_to_all(x.reshape(n, -1), axes, 0, 1, tiled=True))
    loss = sum((v * (i + 1)).sum() for i, v in enumerate(out.values()) if v.requires_grad)
    loss.backward()
    return {k: v.detach().numpy() for k, v in out.items()} | {"grad": x.grad.numpy()}


@pytest.mark.parametrize("mesh_kw", [dict(dp_shard=2), dict(dp_shard=2, tp=2)])
def test_gloo_processes_match_simulation(mesh_kw):
    mesh = fpp.Mesh(**mesh_kw)
    real = fpp.launch(collective_suite, mesh, processes=True, timeout=120)
    sim = fpp.launch(collective_suite, mesh)
    for r, (a, b) in enumerate(zip(real, sim)):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-12, err_msg=f"rank {r} {k}")


def _compiled_fsdp_tp():
    import torch._dynamo.testing

    torch._dynamo.reset()

    def device(x, w):
        w_full = fpp.all_gather(w, "dp_shard", axis=0, tiled=True)       # FSDP gather
        h = fpp.psum(x @ fpp.pvary(w_full, "tp"), "tp")                  # Megatron f / g
        return fpp.psum((h ** 2).sum(), "dp_shard")

    g = torch.Generator().manual_seed(fpp.current_rank())
    x = torch.randn(3, 8, dtype=torch.float64, generator=g)
    w = torch.randn(4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    eager = device(x, w)
    eager.backward()
    grad_eager = w.grad.clone()
    w.grad = None
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(device, backend=counter, fullgraph=True)
    out = compiled(x, w)
    out.backward()
    return eager.item(), out.item(), grad_eager.numpy(), w.grad.numpy(), counter.frame_count


def test_compile_fullgraph_with_collectives_and_gradient():
    results = fpp.launch(_compiled_fsdp_tp, fpp.Mesh(dp_shard=2, tp=2), processes=True, timeout=240)
    for eager, compiled, ge, gc, frames in results:
        assert frames == 1                       # one graph: no graph breaks
        assert compiled == pytest.approx(eager, rel=1e-12)
        np.testing.assert_allclose(gc, ge, rtol=1e-12)


def test_process_failure_names_rank():
    def fn():
        if fpp.current_rank() == 1:
            raise ValueError("bad shard")
        return 0
    with pytest.raises(fpp.DeviceError, match=r"device 1 \(.*dp_shard=1.*\) failed.*bad shard"):
        fpp.launch(fn, fpp.Mesh(dp_shard=2), processes=True, timeout=60)
