"""The compiled step writes its elementwise math into dying buffers (functional_pp/compile/reinplace.py,
docs/compile.md): a compiled AdamW step peaks no higher than the eager step, which updates in
place on its donated gradients, and the rewrite never touches a buffer something else reads."""
import functools

import pytest
import torch
from harness import make_batch
from memtrack import peak_memory
from torch.fx.experimental.proxy_tensor import make_fx

import functional_pp as fpp
from functional_pp.compile.backend import capture_graphs
from functional_pp.compile.reinplace import reinplace
from functional_pp.models import llama
from functional_pp.ops.loss import logits_widened_whole


def _graph(fn, *args):
    gm = make_fx(fn)(*args)
    return gm, sum(1 for n in gm.graph.nodes if n.op == "call_function")


def _writes(gm):
    return _writes_of(gm.graph)


def _writes_of(graph):
    """Nodes that write into an existing buffer (out= or an in-place op)."""
    return [n for n in graph.nodes if isinstance(n.target, torch._ops.OpOverload) and (
        "out" in n.kwargs or n.target._schema.name.endswith("_"))]


def test_dying_intermediates_are_overwritten_with_the_same_result():
    def fn(ms, vs, gs):
        m = torch._foreach_lerp(ms, gs, 0.1)                 # m is returned: kept
        d = torch._foreach_sqrt(torch._foreach_mul(vs, 2.0))  # dies: written in place
        d = torch._foreach_add(d, 1e-8)
        u = torch._foreach_div(m, d)                          # into d (second list)
        return m, [x * 3 + 1 for x in u]
    args = ([torch.randn(5, 3) for _ in range(2)], [torch.rand(5, 3) for _ in range(2)],
            [torch.randn(5, 3) for _ in range(2)])
    gm, _ = _graph(fn, *args)
    expected = gm(*args)
    assert reinplace(gm.graph) >= 4
    gm.recompile()
    writes = _writes(gm)
    assert any(n.target is torch.ops.aten._foreach_add_.Scalar for n in writes)
    assert sum(n.target is torch.ops.aten.div.out for n in writes) == 2
    got = gm(*args)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        assert torch.equal(a, b)


def test_inputs_outputs_and_viewed_buffers_are_not_overwritten():
    def fn(x):
        y = x * 2                       # viewed by a returned alias: must stay intact
        z = y.view(-1)
        w = y + 1
        k = x + 1                       # graph input x is never written
        return z, w, k
    x = torch.randn(4, 4)
    gm, _ = _graph(fn, x)
    assert reinplace(gm.graph) == 0, gm.code
    z, w, k = gm(x)
    assert torch.equal(z, (x * 2).view(-1)) and torch.equal(w, x * 2 + 1) and torch.equal(k, x + 1)


def test_a_buffer_read_later_is_not_overwritten():
    def fn(x):
        y = x * 2
        w = torch.sqrt(y.abs())         # y is still read below
        return w + y
    x = torch.randn(8)
    gm, _ = _graph(fn, x)
    reinplace(gm.graph)
    gm.recompile()
    sqrt = [n for n in gm.graph.nodes if "sqrt" in str(n.target)]
    assert sqrt and all("out" not in n.kwargs or n.kwargs["out"].name != "mul" for n in sqrt)
    assert torch.equal(gm(x), torch.sqrt((x * 2).abs()) + x * 2)


CFG = llama.Config.tiny(layers=2, hidden=128, mlp=512)


def _adamw_run(compile):
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-3, weight_decay=0.1),
                          compile=compile)
    batch = make_batch(CFG, 4, 16)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float32, seed=0))
        # (eager too the loss as a traced step computes it: the two compare bitwise)
        with capture_graphs() as graphs, logits_widened_whole():
            for _ in range(3):
                with peak_memory() as p:
                    state, m = step(state, batch)
        return p.bytes, state["params"], graphs
    return fpp.launch(device, fpp.Mesh())[0]


@pytest.mark.slow
def test_compiled_adamw_step_peaks_like_the_eager_in_place_step():
    peak_eager, params_eager, _ = _adamw_run(False)
    peak, params, graphs = _adamw_run("aot_eager")
    for (path, a), (_, b) in zip(fpp.leaves_with_paths(params), fpp.leaves_with_paths(params_eager)):
        assert torch.equal(a, b), path
    # gradients, new moments: eager writes the denominator, the update and the new weights into
    # the gradient buffers; without the pass every foreach stage adds a parameter-sized buffer
    P = 4 * fpp.count_params(llama.init(CFG))
    # within the 1.1x: eager now peaks at 3.00 P (branch-free in-place guard), compiled 3.12 P
    assert peak <= 1.1 * peak_eager, (peak / P, peak_eager / P)
    assert len(_writes_of(graphs[0])) > 0

