"""The private torch APIs we depend on still behave as we use them."""
import threading

import torch

from functional_pp import torch_private


def test_in_backward_only_inside_a_backward_function():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(torch_private.in_backward())
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(torch_private.in_backward())
            return g

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [False, True] and not torch_private.in_backward()


def test_dynamo_settings_are_thread_local_and_restored():
    import torch._dynamo.config as dcfg
    before = dcfg.trace_autograd_ops
    other = []
    with torch_private.trace_backward(), torch_private.compile_cache_limits(1000):
        assert dcfg.trace_autograd_ops and dcfg.recompile_limit >= 1000
        t = threading.Thread(target=lambda: other.append(dcfg.trace_autograd_ops))
        t.start()
        t.join()
    assert other == [before] and dcfg.trace_autograd_ops == before


def test_apply_function_equals_function_apply_with_gradients():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(x, k):
            return x * k

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.k = inputs[1]

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k, None

    x = torch.arange(3.0, requires_grad=True)
    y = torch_private.apply_function(Scale, x, 3.0)
    assert type(y.grad_fn).__name__ == "ScaleBackward"
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(y, x * 3) and torch.equal(g, torch.full((3,), 3.0))
    compiled = torch.compile(lambda t: torch_private.apply_function(Scale, t, 2.0), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x * 2)
