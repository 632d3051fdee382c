"""Kernel order of an inductor-compiled training step (docs/compile.md "Kernel order"): kernels
run in graph order, so weight gradients are computed in backward instead of being sunk to the
optimizer (which kept all saved activations alive to the end of backward)."""
import functools
import types

import pytest
import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp._torch import kernel_order
from functional_pp.models import llama

CFG = llama.Config.tiny()
BATCH = {k: v.data for k, v in make_batch(CFG, batch=2, seq=16, seed=0).items()}


def _first_loss(compile) -> float:
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-3, weight_decay=0.1),
                          compile=compile, donate_state=True)
    state = step.init(fpp.init(llama.init, CFG, seed=0))
    return step(state, BATCH)[1]["loss"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inductor_step_is_scheduled_in_graph_order(monkeypatch):
    """The reorder runs on the compiled step's kernels, with inductor's locality pass off, and
    returns a permutation of them; the step computes what eager computes. (The sinking it
    undoes shows on the 20 M benchmark model, not on this tiny one: docs/compile.md.)"""
    calls = []
    restore = kernel_order.restore_graph_order

    def spy(nodes):
        out = restore(nodes)
        calls.append((len(nodes), len(set(out)) == len(out) and set(out) == set(nodes),
                      torch._inductor.config.reorder_for_locality))
        return out
    monkeypatch.setattr(kernel_order, "restore_graph_order", spy)
    torch._dynamo.reset()          # compile again here, with the spy
    compiled = _first_loss(True)
    assert calls, "the kernel reorder did not run on the inductor-compiled step"
    assert all(n > 100 and permutation and locality is False for n, permutation, locality in calls), calls
    assert compiled == pytest.approx(_first_loss(False), rel=1e-6)


def test_restored_order_is_a_topological_order_by_latest_member():
    """On stand-in scheduler nodes: sorted by their latest FX node, producers first."""
    graph = torch.fx.Graph()
    fx = [graph.placeholder(f"n{i}") for i in range(6)]

    class Dep:
        def __init__(self, name):
            self.name = name

    class Node:            # the scheduler-node surface restore_graph_order reads
        def __init__(self, name, origins, deps=()):
            self.name, self.node = name, self
            self.origins = {fx[i] for i in origins}
            self.unmet_dependencies = {Dep(d) for d in deps}

        def get_nodes(self):
            return [self]

        def get_buffer_names(self):
            return {self.name}

    a = Node("a", [0])                      # forward
    fused = Node("fused", [1, 4], ["a"])    # a forward value fused into a backward kernel
    w = Node("w", [3], ["a"])               # weight gradient: earlier in the graph than fused's end
    b = Node("b", [5], ["fused", "w"])
    late_dep = Node("late", [2], ["b"])     # sorts early by position but needs b: dependencies win
    from torch._inductor.virtualized import V

    class Lowering:
        module = types.SimpleNamespace(graph=graph)
    with V.set_graph_handler(Lowering()):
        # by earliest member (inductor's fusion order) fused would run before w
        assert [n.name for n in kernel_order.restore_graph_order([a, fused, w, b])] == ["a", "w", "fused", "b"]
        out = kernel_order.restore_graph_order([a, fused, late_dep, w, b])
    assert [n.name for n in out] == ["a", "fused", "w", "b", "late"]


def test_loop_reordering_is_turned_off_where_inductor_fails_on_it():
    """torch 2.11's inductor fails on a whole step with loop reordering (an H200 run): the step's
    patches turn it off there and leave inductor's default elsewhere."""
    assert kernel_order.inductor_patches("2.11.0+cu130")["loop_ordering_after_fusion"] is False
    for version in ("2.13.0+cpu", "2.15.0"):
        patches = kernel_order.inductor_patches(version)
        assert "loop_ordering_after_fusion" not in patches and patches["reorder_for_locality"] is False
        assert patches["_post_fusion_custom_pass"] is kernel_order.restore_graph_order
