"""Simulated devices share one compilation (docs/compile.md): traced collectives name mesh
axes and resolve the running device's group when they run, and the first device compiles
while the others wait for its graph. Code that reads the device's index still gets a graph
per device, with the right values."""
import torch

import functional_pp as fpp
from functional_pp.compile.gate import CompileGate


def _counting_backend(compiled: list):
    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward
    return backend


def _run_gated(fn, n=4):
    compiled = []
    gate = CompileGate(torch.compile(fn, backend=_counting_backend(compiled), fullgraph=True), fn.__code__)

    def device():
        x = torch.full((3,), float(fpp.current_rank()))
        with fpp.configure():     # a policy in force on the thread before tracing (as in a TrainStep)
            return gate(x), gate(x + 1)
    return fpp.launch(device, fpp.Mesh(dp_shard=n), timeout=600), compiled


def _collectives(x):
    return (fpp.psum(x * 2, "dp_shard") + fpp.all_gather(x, "dp_shard", tiled=True).sum()
            + fpp.psum_scatter(torch.cat([x] * 4), "dp_shard", tiled=True))


def test_four_simulated_devices_compile_one_graph_with_collectives():
    out, compiled = _run_gated(_collectives)
    assert len(compiled) == 1                   # one compilation served all four devices
    for first, second in out:                   # each device's own group and rank at run time
        torch.testing.assert_close(first, torch.full((3,), 2 * 6.0 + 3 * 6.0 + 6.0))
        torch.testing.assert_close(second, torch.full((3,), 2 * 10.0 + 3 * 10.0 + 10.0))


def _rank_dependent(x):
    return x + fpp.axis_index("dp_shard") * 10


def test_code_reading_the_device_index_compiles_per_device_and_stays_right():
    out, compiled = _run_gated(_rank_dependent)
    assert len(compiled) == 4
    for rank, (first, _) in enumerate(out):
        torch.testing.assert_close(first, torch.full((3,), 11.0 * rank))


def _configured(fn, *args):
    with fpp.configure():
        return fn(*args)


def test_a_new_launch_opens_the_gate_again():
    compiled = []
    gate = CompileGate(torch.compile(_collectives, backend=_counting_backend(compiled), fullgraph=True),
                       _collectives.__code__)
    for _ in range(2):                          # a new world: its collectives are another graph
        fpp.launch(lambda: _configured(gate, torch.ones(3)), fpp.Mesh(dp_shard=4), timeout=600)
    assert len(compiled) == 2
