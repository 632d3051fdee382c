"""Kernel order of an inductor-compiled training step (docs/compile.md "Kernel order"): every
weight gradient is computed in backward, before the embedding's gradient ends it, not sunk to
the optimizer (which kept all saved activations alive to the end of backward)."""
import functools
import re
import types

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import functional_pp as fpp
from functional_pp import kernel_order
from functional_pp.models import llama

from harness import make_batch

CFG = llama.Config.tiny()


TOKENS = 2 * 24          # rows of every activation matmul; no weight has a dimension of 48
BATCH = {k: v.data for k, v in make_batch(CFG, batch=2, seq=24, seed=0).items()}


def _step_code() -> tuple[str, dict]:
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-3, weight_decay=0.1),
                          compile=True, donate_state=True)
    state = step.init(fpp.init(llama.init, CFG, seed=0))
    (state, metrics), codes = run_and_get_code(step, state, BATCH)
    return "\n".join(codes), metrics


def _matmul_rows(code: str) -> list[int]:
    """Rows of the result of every ``extern_kernels.mm`` of the compiled wrapper's ``call``, in
    run order (the first operand's first dimension)."""
    body = code[code.index("def call(self, args)"):]
    shapes = dict(re.findall(r"(buf\d+) = empty_strided_cpu\(\((\d+),", body))
    rows = []
    for first in re.findall(r"extern_kernels\.mm\(([^,]+(?:, \(\d+)?)", body):
        m = re.match(r"reinterpret_tensor\(\w+, \((\d+)", first)
        rows.append(int(m.group(1)) if m else int(shapes.get(first.strip(), -1)))
    return rows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_weight_gradients_are_computed_in_backward_not_at_the_optimizer():
    code, metrics = _step_code()
    rows = _matmul_rows(code)
    # 2 layers x 7 weights + lm_head: 15 forward matmuls, 15 input and 15 weight gradients
    assert len(rows) == 45 and rows.count(TOKENS) == 30, rows
    last_activation = max(i for i, r in enumerate(rows) if r == TOKENS)
    late = [r for r in rows[last_activation:] if r != TOKENS]
    # in autograd's order only the first layer's weight gradients follow its input gradient
    assert len(late) <= 7, f"{len(late)} of 15 weight gradients run after the whole backward: {rows}"
    assert metrics["skipped"] == 0


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
