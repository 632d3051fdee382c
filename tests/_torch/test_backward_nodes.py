"""How the compile passes find a traced step's backward (functional_pp/_torch/__init__.py
``dynamo_marks_backward_nodes``; compile/recompute.py ``is_backward``): dynamo marks the nodes
``torch.autograd.grad`` traces from torch 2.12 on; on torch 2.11 the tag the step sets around
its ``autograd.grad`` does. Both are checked on the torch installed."""
import torch

from functional_pp._torch import compile_backend, dynamo_marks_backward_nodes, is_backward_node, trace_backward
from functional_pp.compile.recompute import backward_region, is_backward


def _graph(tagged: bool):
    graphs = []

    def f(x, seed):
        y = x + seed
        z = (y.sin() * 3).sum()
        if tagged:
            with backward_region():
                return torch.autograd.grad(z, [y])[0]
        return torch.autograd.grad(z, [y])[0]

    with trace_backward():
        torch.compile(f, backend=compile_backend("aot_eager", graphs.append), fullgraph=True)(
            torch.ones(3), torch.zeros((), requires_grad=True))
    torch._dynamo.reset()
    return [n for n in graphs[-1].nodes if n.op == "call_function"]


def test_the_capability_is_what_dynamo_marks():
    nodes = _graph(tagged=False)
    assert dynamo_marks_backward_nodes() is any(is_backward_node(n) for n in nodes)


def test_the_backward_is_found_on_either_path():
    nodes = _graph(tagged=True)
    flags = [is_backward(n) for n in nodes]
    first = flags.index(True)
    assert first > 0 and all(flags[first:]), [(n.name, f) for n, f in zip(nodes, flags)]
    assert not any(flags[:first])
    assert all(n.meta.get("custom", {}).get("fpp_backward") for n in nodes[first:])   # the step's tag is there too
