"""The tensors a traced step differentiates against, on every supported torch.

A step takes gradients with ``torch.autograd.grad(loss, xs)`` where each ``x`` in ``xs`` is a
parameter made differentiable inside the step: ``p.detach().requires_grad_()``. Dynamo traces
that call on an intermediate tensor from torch 2.12 on; torch 2.11's dynamo refuses it
("Unsupported Tensor.requires_grad_() call") and also refuses factories with
``requires_grad=True``, but it traces ``autograd.grad`` with respect to any tensor that derives
from a graph input which requires grad. There, the host passes a 0-dim zero that requires
grad (:func:`grad_seed`) and the step differentiates against ``p.detach() + seed``: the same
values (``-0.0`` becomes ``0.0``), a fresh tensor in the graph; a cast to the compute dtype
right after it fuses with the addition. No output of the step depends on the seed with a
gradient, so AOTAutograd still compiles an inference graph (one graph, no joint backward).

The capability is probed once per process (:func:`dynamo_traces_requires_grad`), not read from
the version number (tests/_torch/test_grad_leaves.py checks both paths on the torch installed)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def dynamo_traces_requires_grad() -> bool:
    """Capability: whether dynamo traces ``x.detach().requires_grad_()`` on a tensor made inside
    the compiled function and differentiates against it (True on torch 2.13, False on 2.11).
    Probed by compiling such a function once (dynamo's ``eager`` backend: no code generation;
    its cache entry stays, as a reset would drop every other compiled function's)."""
    import torch._dynamo.config as dcfg

    def probe(x: torch.Tensor) -> torch.Tensor:
        y = (x * 2).detach().requires_grad_()
        return torch.autograd.grad((y * y).sum(), [y])[0]

    try:
        with dcfg.patch(trace_autograd_ops=True):
            torch.compile(probe, backend="eager", fullgraph=True)(torch.ones(()))
        return True
    except Exception as e:      # dynamo's Unsupported (a graph break refused by fullgraph)
        if type(e).__name__ not in ("Unsupported", "UserError") and "requires_grad" not in str(e):
            raise
        return False


def grad_seed(device: torch.device | str | None, compiled: bool) -> torch.Tensor | None:
    """Host side, outside the compiled step: the seed to pass into a compiled step where dynamo
    cannot make tensors differentiable itself (a 0-dim fp32 zero requiring grad on ``device``),
    else None."""
    if not compiled or dynamo_traces_requires_grad():
        return None
    return torch.zeros((), device=device, requires_grad=True)


def differentiable(x: torch.Tensor, seed: torch.Tensor | None, requires: bool = True) -> torch.Tensor:
    """``x`` as a tensor to differentiate against (``requires``) or a detached one: a leaf made
    by ``requires_grad_()``, or ``x + seed`` where a ``seed`` from :func:`grad_seed` is given."""
    x = x.detach()
    if not requires:
        return x
    if seed is None:
        return x.requires_grad_()
    return x + seed.to(dtype=x.dtype, device=x.device)
