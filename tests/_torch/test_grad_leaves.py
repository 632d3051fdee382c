"""The tensors a compiled step differentiates against (functional_pp/_torch/grad_leaves.py):
dynamo traces ``requires_grad_()`` on intermediates from torch 2.12; on 2.11 the host passes a
zero seed that requires grad. Both paths are run here on the torch installed (the seed path is
forced where the capability is present) and must give the eager step's losses and parameters."""
import functools

import optree
import pytest
import torch

import functional_pp as fpp
from functional_pp._torch import grad_leaves
from functional_pp.models import llama
from functional_pp.ops.loss import logits_widened_whole


def test_capability_matches_what_dynamo_does():
    """The probe's answer is what compiling ``detach().requires_grad_()`` does on this torch."""
    def f(x):
        y = (x + 1).detach().requires_grad_()
        return torch.autograd.grad(y.sum(), [y])[0]

    try:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
        works = True
    except Exception:
        works = False
    finally:
        torch._dynamo.reset()
    assert grad_leaves.dynamo_traces_requires_grad() is works


def test_differentiable_is_the_same_values_with_gradients():
    x = torch.tensor([1.5, -2.0, 0.0], dtype=torch.bfloat16)
    seed = torch.zeros((), requires_grad=True)
    for s in (None, seed):
        y = grad_leaves.differentiable(x, s)
        assert y.requires_grad and y.dtype == x.dtype and torch.equal(y.detach(), x)
        (g,) = torch.autograd.grad((y.float() ** 2).sum(), [y])
        assert torch.equal(g, (2 * x.float()).to(g.dtype))
    assert not grad_leaves.differentiable(x, seed, requires=False).requires_grad
    assert grad_leaves.grad_seed("cpu", compiled=False) is None


def _train(compile_, steps=3):
    cfg = llama.Config.tiny()
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-2), compile=compile_,
                          precision="bf16")
    state = step.init(fpp.init(llama.init, cfg, seed=0))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab, (2, 17), generator=g)
    batch = {"tokens": data[:, :-1], "labels": data[:, 1:]}
    losses = []
    for _ in range(steps):
        with logits_widened_whole():        # (eager too the loss as a traced step computes it)
            state, m = step(state, batch)
        losses.append(m["loss"])
    return losses, optree.tree_leaves(state["params"])


@pytest.mark.parametrize("seeded", [False, True], ids=["native", "seeded"])
def test_compiled_step_equals_eager_on_either_path(monkeypatch, seeded):
    """A whole-step compile (aot_eager) equals the eager step, with the parameters made
    differentiable by dynamo (where it can) or by the seed (torch 2.11's path, forced here)."""
    if not seeded and not grad_leaves.dynamo_traces_requires_grad():
        pytest.skip("this torch's dynamo cannot trace requires_grad_() (the seeded case covers it)")
    if seeded:
        monkeypatch.setattr(grad_leaves, "dynamo_traces_requires_grad", lambda: False)
    made = []
    real = grad_leaves.grad_seed
    monkeypatch.setattr("functional_pp.step.train.grad_seed",
                        lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    eager_losses, eager_params = _train(False)
    losses, params = _train("aot_eager")
    assert (made[-1] is not None) == seeded
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-5)
    for a, b in zip(params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
