"""torch's selective checkpoint with the policy shown each kept result
(functional_pp/_torch/selective_checkpoint.py): torch 2.11 asks the policy before running the op,
without ``ctx.op_output``; functional_pp's forward context asks it again after, on every torch."""
import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from functional_pp._torch.selective_checkpoint import checkpoint_policy_sees_outputs, selective_checkpoint_contexts


def _run(x):
    outputs, recomputed = [], []

    def policy(ctx, func, *args, **kwargs):
        if ctx.is_recompute:
            recomputed.append(func)
        elif getattr(ctx, "op_output", None) is not None:
            outputs.append((func, ctx.op_output))
        return CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def region(x):
        return (x @ x).sin().sum()

    y = checkpoint(region, x, use_reentrant=False, context_fn=functools.partial(selective_checkpoint_contexts, policy))
    grad, = torch.autograd.grad(y, x)
    return y, grad, outputs, recomputed


def test_the_policy_sees_every_forward_result_and_the_region_differentiates():
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    y, grad, outputs, _ = _run(x)
    mm = [out for func, out in outputs if func is torch.ops.aten.mm.default]
    assert len(mm) == 1
    torch.testing.assert_close(mm[0], x.detach() @ x.detach(), rtol=0, atol=0)
    assert torch.ops.aten.sin.default in [func for func, _ in outputs]
    ref = x.detach().clone().requires_grad_()
    torch.testing.assert_close(grad, torch.autograd.grad((ref @ ref).sin().sum(), ref)[0])
    torch.testing.assert_close(y, (ref @ ref).sin().sum().detach())


def test_the_capability_on_this_torch():
    sees = checkpoint_policy_sees_outputs()
    assert isinstance(sees, bool)
    print(f"torch {torch.__version__}: the selective checkpoint policy sees op_output={sees}")


def test_work_outside_the_selective_modes_is_not_matched_between_forward_and_recomputation():
    """A region whose recomputation does an extra ``cat`` that its forward does not (an FSDP unit's
    gather: prefetched by the layer before in forward, issued in the recomputation) fails torch's op matching, unless the
    extra work runs :func:`outside_selective_checkpoint`; then the gradient is the plain one."""
    import contextlib

    import pytest

    from functional_pp._torch.selective_checkpoint import outside_selective_checkpoint

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def grad(outside):
        calls = []

        def region(x):
            with outside() if outside else contextlib.nullcontext():
                if calls:                              # (the recomputation only)
                    torch.cat([x, x])
                w = torch.cat([x, x], 0)[:2]
            calls.append(1)
            return (torch.cat([x, x], 1)[:, :2] @ w).sin().sum()
        x = torch.arange(4.0).reshape(2, 2).requires_grad_()
        y = checkpoint(region, x, use_reentrant=False,
                       context_fn=functools.partial(selective_checkpoint_contexts, policy))
        return torch.autograd.grad(y, x)[0]
    with pytest.raises(RuntimeError, match="cat.* not found in storage"):
        grad(None)
    x = torch.arange(4.0).reshape(2, 2).requires_grad_()
    torch.testing.assert_close(grad(outside_selective_checkpoint),
                               torch.autograd.grad((x @ x).sin().sum(), x)[0])
