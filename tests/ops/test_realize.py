"""``ops.realized``: eager it is no op at all; in a compiled step each residual sum of the Llama
decoder, and its gradient, is computed once into a buffer that every kernel reads
(docs/compile.md, "The residual stream computed once"), with the step's values unchanged."""
import contextlib
import functools

import torch
from harness import make_batch
from torch._inductor.utils import run_and_get_code

import functional_pp as fpp
from functional_pp.compile.backend import capture_graphs
from functional_pp.compile.recompute import is_backward
from functional_pp.models import llama
from functional_pp.ops.loss import logits_widened_whole
from functional_pp.ops.realize import _Realized


def test_eager_realized_is_the_value_itself():
    x = fpp.named(torch.randn(2, 3, 4), "batch seq hidden")
    assert fpp.ops.realized(x) is x


def _chain(realize, x, a, b, c):
    """A residual stream of three sums, each read by a norm (as a decoder's layers read it)."""
    keep = _Realized.apply if realize else (lambda t: t)
    outs = []
    for d in (a, b, c):
        x = keep(x + d)
        outs.append(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    return sum(o.sum() for o in outs)


def test_inductor_writes_each_realized_sum_into_a_buffer_of_its_own():
    torch.manual_seed(0)
    args = [torch.randn(64, 32, requires_grad=True) for _ in range(4)]
    results, stored = {}, {}
    for realize in (False, True):
        fn = torch.compile(functools.partial(_chain, realize), backend="inductor", fullgraph=True)

        def step():
            loss = fn(*args)
            return (loss, *torch.autograd.grad(loss, args))
        out, (forward, *_) = run_and_get_code(step)
        results[realize] = out
        stored[realize] = forward.count("empty_strided_cpu((64, 32), (32, 1), torch.float32)")
        torch._dynamo.reset()
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # inlined, the sums are recomputed inside the kernels that read them; realized, each of the
    # three is written once
    assert stored[True] >= 3 and stored[True] > stored[False], stored


def test_a_compiled_llama_step_realizes_every_residual_sum_and_equals_eager():
    cfg = llama.Config.tiny()
    batch = {k: v for k, v in make_batch(cfg, batch=2, seq=16, seed=0).items()}
    losses = {}
    for compile_ in (False, "aot_eager"):
        step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.sgd(0.1), compile=compile_)
        state = step.init(fpp.init(llama.init, cfg, seed=0))
        # (eager, the loss as the traced step computes it: logits_widened_whole)
        with capture_graphs() as graphs, (contextlib.nullcontext() if compile_ else logits_widened_whole()):
            state, m1 = step(state, batch)
            state, m2 = step(state, batch)
        losses[compile_] = (m1["loss"], m2["loss"])
        if compile_:
            (graph,) = graphs
            nodes = list(graph.nodes)
            first_backward = next(i for i, n in enumerate(nodes) if is_backward(n))
            views = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.as_strided.default]
            # the embedding and two sums per layer, forward; their gradients, backward
            assert sum(i < first_backward for i in views) == 1 + 2 * cfg.layers, views
            assert sum(i > first_backward for i in views) == 1 + 2 * cfg.layers, views
            # and nothing of the forward is taken for backward (remat and the kernel order read it)
            assert not any((n.meta.get("custom") or {}).get("fpp_backward") for n in nodes[:first_backward])
    assert losses[False] == losses["aot_eager"]       # bitwise: the views change no value
