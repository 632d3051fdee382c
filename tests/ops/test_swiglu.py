"""ops.swiglu: ``silu(gate) * up`` whose backward recomputes ``silu(gate)`` in compiled steps
(docs/compile.md "SwiGLU recomputed in backward"). Oracle: autograd of ``F.silu(gate) * up``,
and the one-device step of a gated MLP written with ``ops.silu(gate) * up``."""
import functools

import pytest
import torch
import torch.nn.functional as F
from harness import make_batch

import functional_pp as fpp
from functional_pp import ops
from functional_pp.compile.backend import capture_graphs
from functional_pp.compile.recompute import in_backward_region
from functional_pp.models import llama
from functional_pp.ops.swiglu import swiglu_tensors


def _reference(gate, up, grad):
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    out = F.silu(gate) * up
    return (out.detach(), *torch.autograd.grad(out, (gate, up), grad))


def _operands(dtype=torch.float64, shape=(3, 5, 7)):
    g = torch.Generator().manual_seed(0)
    return [4 * torch.randn(shape, generator=g, dtype=dtype) for _ in range(3)]   # gate, up, grad


def test_eager_swiglu_equals_autograd_of_silu_times_up_bitwise():
    """Eager: the forward's silu is kept and the backward runs autograd's own ops: the same
    bits, in float32 and float64; gradcheck confirms the backward is the derivative."""
    for dtype in (torch.float32, torch.float64):
        gate, up, grad = _operands(dtype)
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = swiglu_tensors(g, u)
        got = (out.detach(), *torch.autograd.grad(out, (g, u), grad))
        for a, b in zip(got, _reference(gate, up, grad)):
            assert torch.equal(a, b)
    gate, up, _ = _operands(shape=(2, 3))
    assert torch.autograd.gradcheck(swiglu_tensors, (gate.requires_grad_(), up.requires_grad_()))
    assert torch.autograd.gradgradcheck(swiglu_tensors, (gate, up))


def test_eager_swiglu_is_autograds_own_ops():
    """Eager, ``silu(gate) * up`` is computed by autograd's own ops (no Python Function to
    enter in forward and backward: docs/eager_overhead.md "Issue 38, fourth round")."""
    gate, up, _ = _operands()
    out = swiglu_tensors(gate.requires_grad_(), up.requires_grad_())
    assert type(out.grad_fn).__name__ == "MulBackward0"
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "SiluBackward0"


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_swiglu_recomputes_silu_and_matches_autograd(backend):
    """Traced, the forward saves only gate and up and the backward computes silu(gate) again:
    values and gradients equal autograd of F.silu(gate) * up (within rounding with inductor)."""
    torch._dynamo.reset()
    gate, up, grad = _operands()
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = torch.compile(swiglu_tensors, backend=backend, fullgraph=True)(g, u)
    out.backward(grad)
    for a, b in zip((out.detach(), g.grad, u.grad), _reference(gate, up, grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _mlp_decls(dtype=torch.float64):
    return {"w_gate": fpp.param((8, 12), "hidden mlp", scale=0.5, dtype=dtype),
            "w_up": fpp.param((8, 12), "hidden mlp", scale=0.5, dtype=dtype),
            "w_down": fpp.param((12, 8), "mlp hidden", scale=0.5, dtype=dtype)}


def _mlp_loss(params, batch, swiglu=True):
    x = batch["x"].astype(params["w_gate"].data.dtype)       # (the compute dtype under precision="bf16")
    gate = ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", x, params["w_gate"])
    up = ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", x, params["w_up"])
    h = ops.swiglu(gate, up) if swiglu else ops.silu(gate) * up
    out = ops.einsum("batch seq mlp, mlp hidden -> batch seq hidden", h, params["w_down"])
    return ops.mean(out * out, ("batch", "seq", "hidden"))


def _mlp_steps(mesh, rules, swiglu, compile, steps=2, precision="fp32"):
    """Per device: the losses and the gathered parameters after ``steps`` SGD steps."""
    dtype = torch.float64 if precision == "fp32" else torch.float32      # (fp32 master weights)
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(2), dtype=dtype)
    step = fpp.train_step(functools.partial(_mlp_loss, swiglu=swiglu), fpp.optim.sgd(0.5), mesh=mesh,
                          rules=rules, compile=compile, batch_dims={"x": "batch seq hidden"}, precision=precision)

    def device():
        state = step.init(fpp.init(_mlp_decls, dtype, mesh=mesh, rules=rules, seed=0))
        losses = []
        for _ in range(steps):
            state, m = step(state, {"x": x})
            losses.append(m["loss"])
        if mesh is None:
            return losses, state["params"]
        with fpp.use_rules(rules):
            return losses, fpp.gather_tree(state["params"], _mlp_decls(dtype), rules)
    return fpp.launch(device, mesh) if mesh is not None else [device()]


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_swiglu_on_a_tp_mesh_matches_one_device_silu_times_up(compile):
    """Gated MLP with mlp split over tp (2 simulated devices): losses and SGD-updated weights
    (so the gradients) equal the one-device eager step written as silu(gate) * up."""
    ref_losses, ref_params = _mlp_steps(None, fpp.Rules(), swiglu=False, compile=False)[0]
    mesh, rules = fpp.Mesh(tp=2), fpp.Rules(mlp="tp")
    with fpp.comm_report() as rep:
        results = _mlp_steps(mesh, rules, swiglu=True, compile=compile)
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=0)
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=1e-12, atol=1e-14)
        assert ref_params["w_gate"].abs().sum() > 0


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_bf16_swiglu_on_a_tp_mesh_matches_one_device_silu_times_up(compile):
    """Mixed precision (bf16 compute, fp32 master weights): within bf16 rounding of the
    one-device eager bf16 step written as silu(gate) * up."""
    ref_losses, ref_params = _mlp_steps(None, fpp.Rules(), swiglu=False, compile=False, precision="bf16")[0]
    for losses, params in _mlp_steps(fpp.Mesh(tp=2), fpp.Rules(mlp="tp"), swiglu=True, compile=compile,
                                     precision="bf16"):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=2e-2, atol=2e-3)


def test_a_compiled_llama_step_keeps_no_silu_for_backward():
    """In the traced step no forward silu(gate) is read by backward nodes (written with
    ops.silu(gate) * up, the product's backward reads it); the step equals the eager step."""
    cfg = llama.Config.tiny()
    batch = {k: v.data for k, v in make_batch(cfg, batch=2, seq=16, seed=0).items()}
    losses = {}
    for compile in (False, "aot_eager"):
        step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.sgd(0.1), compile=compile)
        state = step.init(fpp.init(llama.init, cfg, seed=0))
        with capture_graphs() as graphs:
            state, m = step(state, batch)
            losses[compile] = (m["loss"], step(state, batch)[1]["loss"])
    (graph,) = graphs
    forward_silu = [n for n in graph.nodes if n.target is torch.ops.aten.silu.default and not in_backward_region(n)]
    assert len(forward_silu) == cfg.layers
    read_by_backward = [n.name for n in forward_silu if any(in_backward_region(u) for u in n.users)]
    assert not read_by_backward, f"forward silu values kept for backward: {read_by_backward}"
    assert sum(n.target is torch.ops.aten.silu.default for n in graph.nodes) == 2 * cfg.layers   # recomputed
    torch.testing.assert_close(torch.tensor(losses["aot_eager"]), torch.tensor(losses[False]), rtol=1e-6, atol=0)


def test_swiglu_refuses_operands_that_are_not_one_gated_pair():
    gate = fpp.named(torch.ones(2, 3), "batch mlp")
    with pytest.raises(ValueError, match=r"swiglu: gate has dims \('batch', 'mlp'\) and up \('batch', 'hidden'\)"):
        ops.swiglu(gate, fpp.named(torch.ones(2, 3), "batch hidden"))
    with pytest.raises(TypeError, match="swiglu: gate and up must be named arrays, got Named and Tensor"):
        ops.swiglu(gate, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"swiglu: gate has shape \(2, 3\) and up \(3, 2\)"):
        swiglu_tensors(torch.ones(2, 3), torch.ones(3, 2))
    out = ops.swiglu(gate, fpp.named(torch.full((3, 2), 2.0), "mlp batch"))     # any dimension order
    assert out.dims == ("batch", "mlp") and torch.allclose(out.data, 2 * F.silu(torch.ones(2, 3)))
