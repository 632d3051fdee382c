"""The compiled step's kernels against plain torch's, without a GPU (docs/gpu.md "Kernels of the
compiled step, without a GPU"): one whole step of the tiny Llama compiled with inductor on the
CPU (``fpp.train_step(compile=True)``, bf16 compute as on the GPU) against the same model as a
plain ``nn.Module`` with ``torch.compile`` of forward + loss and ``AdamW(fused=True)``, as
``benchmarks/gpu.py`` runs them. Each side's launches per step (inductor's generated kernels,
the extern kernels and ops its code calls, the ops run outside the graphs) and host reads are
counted by ``benchmarks/kernel_count.py`` under the profiler."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernel_count as kc  # noqa: E402

LAYERS = (1, 2)
# named margins: launches ours may make beyond plain torch's (measured on torch 2.13, CPU, bf16:
# per layer 30 against 35, update 1 against 2, whole step 45 against 47 and 75 against 82)
LAYER_MARGIN = 0       # per layer: the casts of the fp32 masters to bf16 are one foreach copy, which
#                        inductor fuses into the layers' norm kernels (step/precision_cast.py)
UPDATE_MARGIN = 0      # the update: plain torch's fused AdamW and its step counter's increment are 2 ops
STEP_MARGIN = 0        # the whole step (ours: 2 rotary table kernels and their 2 opaque copies,
#                        where plain torch has the backward's seed, the step counter, the optimizer)


def _count(layers: int) -> dict:
    cfg = kc.tiny_config(layers)
    batch = kc.make_batch(cfg, 2, 32, "cpu")
    return {side.name: kc.measure(side, cfg, "bf16", batch) for side in (kc.Functional, kc.Plain)}


# one fixture per depth: each test compiles at most one depth's two sides (a few minutes)
@pytest.fixture(scope="module")
def one_layer():
    return _count(LAYERS[0])


@pytest.fixture(scope="module")
def two_layers():
    return _count(LAYERS[1])


def _phases(few, many, name):
    return kc.phases(few[name][0], many[name][0], LAYERS)


def _show(counted, name):
    return "\n".join(counted[name][0].table())


def _whole_step(counted):
    ours, plain = counted["functional"][0], counted["plain"][0]
    assert counted["functional"][1][0] == pytest.approx(counted["plain"][1][0], rel=2e-2)   # the same model
    assert ours.total <= plain.total + STEP_MARGIN, (ours.total, plain.total, _show(counted, "functional"))
    # one compiled graph per step, nothing read to the host inside it; outside it, the step's
    # one read of its metrics (plain torch's ``loss.item()``)
    assert ours.graph_calls == 1 and plain.graph_calls == 2, (ours.graph_calls, plain.graph_calls)
    assert ours.reads("graph") == 0, ours.host_reads
    assert ours.reads() <= plain.reads() == 1, (ours.host_reads, plain.host_reads)


@pytest.mark.slow
@pytest.mark.timeout(1500)     # two inductor compilations: minutes on a loaded 2-core machine
def test_one_layer_step_launches_no_more_than_plain_torchs_and_reads_nothing_inside(one_layer):
    _whole_step(one_layer)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_layer_step_launches_no_more_than_plain_torchs_and_reads_nothing_inside(two_layers):
    _whole_step(two_layers)


@pytest.mark.slow
def test_a_layer_launches_no_more_kernels_than_the_plain_modules(one_layer, two_layers):
    ours, plain = _phases(one_layer, two_layers, "functional"), _phases(one_layer, two_layers, "plain")
    assert ours["per_layer"] <= plain["per_layer"] + LAYER_MARGIN, (ours, plain, _show(two_layers, "functional"))


@pytest.mark.slow
def test_the_update_launches_no_more_kernels_than_fused_adamw_at_any_depth(one_layer, two_layers):
    ours, plain = _phases(one_layer, two_layers, "functional"), _phases(one_layer, two_layers, "plain")
    assert ours["update"] <= plain["update"] + UPDATE_MARGIN, (ours, plain, _show(one_layer, "functional"))
    assert ours["update_per_layer"] == 0 == plain["update_per_layer"], (ours, plain)


# --------------------------------------------------------------------------- the counter itself
def test_the_counter_sees_kernels_extern_calls_eager_ops_and_host_reads():
    """A small compiled function: its fused elementwise kernel, its matmul (an extern kernel)
    in the graph; the eager op and ``item`` outside it; a graph break's read inside."""
    w = torch.randn(8, 8)

    def f(x):
        return (x.sin() * 2 + 1) @ w

    def g(x):
        y = x.cos() + 1
        if y.sum().item() > 0:          # a host read: the graph breaks here
            y = y * 3
        return y @ w

    cf, cg = torch.compile(f), torch.compile(g)
    x = torch.randn(4, 8)
    with kc.kernel_events():
        cf(x), cg(x)

        def call():
            z = cf(x) + 1
            return z.sum().item()
        counted = kc.count_launches(call)
        broken = kc.count_launches(lambda: cg(x))
    assert counted.of("graph", lambda n: n == "aten::mm") == 1, counted.table()
    assert counted.of("graph", kc._is_kernel) == 1, counted.table()
    assert counted.of("eager") == 2, counted.table()          # the add and the sum
    assert counted.graph_calls == 1
    assert counted.reads("graph") == 0 and counted.reads("eager") == 1, counted.host_reads
    assert broken.graph_calls == 2 and broken.reads("graph") == 1, (broken.graph_calls, broken.host_reads)
    # a backward graph, run by the autograd engine: its kernels count inside a graph
    xg = torch.randn(4, 8, requires_grad=True)
    with kc.kernel_events():
        cf(xg).sum().backward()
        backward = kc.count_launches(lambda: cf(xg).sum().backward())
    assert backward.graph_calls == 2 and backward.of("graph", lambda n: n == "aten::mm") == 2, backward.table()
    assert broken.of("graph", lambda n: n == "aten::mm") == 1 and broken.of("eager") == 0, broken.table()


@pytest.mark.slow
def test_only_a_declared_tied_gradient_is_copied_out_of_the_update_kernel():
    """A compiled 16-bit step copies the gradient of a parameter the forward declares tied
    (``fpp.tied``: the tied embedding) through ``fpp::materialize`` (compile/barrier.py), and
    no other gradient: the rotary tables' two copies and the embedding's one."""
    cfg = kc.llama.Config.tiny(layers=1, tie_embeddings=True)
    batch = kc.make_batch(cfg, 2, 16, "cpu")
    opt = kc.fpp.optim.adamw(1e-3)
    step = kc.fpp.train_step(kc.functools.partial(kc.llama.loss, cfg=cfg), opt, precision="bf16",
                             compile="aot_eager", donate_state=True)
    state = [step.init(kc.fpp.init(kc.llama.init, cfg, seed=0))]

    def one():
        state[0], m = step(state[0], batch)
    one()
    counted = kc.count_launches(one)
    copies = counted.of("graph", lambda n: n == "fpp::materialize")
    if copies == 0:     # (torch 2.14's profiler names the op's body, the clone, not the custom op)
        copies = counted.of("graph", lambda n: n == "aten::clone")
    assert copies == 3, counted.table()
