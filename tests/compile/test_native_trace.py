"""The compiled step traced natively (step/native_trace.py, docs/compile.md "Tracing
time"): dynamo interprets a few lines whatever the model's depth, the step equals its
dynamo-interpreted self and eager, a trace that reads the device's rank gets a graph per
simulated device (one for all otherwise), another mesh is another compilation, and the
token-id checks the step defers are raised on every call, cached ones included."""
import functools

import optree
import pytest
import torch
from harness import assert_same_run, launch_steps, make_batch

import functional_pp as fpp
from functional_pp._torch import counting_interpreted_instructions
from functional_pp.models import llama
from functional_pp.ops.token_ids import TokenIdError

CFG = llama.Config.tiny(layers=1, hidden=32, mlp=64, heads=4, kv_heads=2)


def _first_step(layers):
    """Instructions dynamo interprets compiling a step of a ``layers``-layer Llama, and the
    tensors the step takes."""
    cfg = llama.Config.tiny(layers=layers, hidden=32, mlp=64, heads=4, kv_heads=2)
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-3), compile="aot_eager")
    batch = {k: v.data for k, v in make_batch(cfg, batch=2, seq=8).items()}

    def device():
        state = step.init(fpp.init(llama.init, cfg, torch.float32, seed=0))
        with counting_interpreted_instructions() as counts:
            step(state, batch)
        return counts[0], len(optree.tree_leaves(state))
    return fpp.launch(device, fpp.Mesh())[0]


def test_dynamo_interprets_only_the_passing_of_tensors_whatever_the_depth():
    (one, tensors_one), (three, tensors_three) = _first_step(1), _first_step(3)
    # the layers' Python runs natively: what grows with depth is dynamo handing over each
    # tensor (~150 instructions), not the model's Python (~3,000 per tensor: ~80 k per layer)
    assert three - one < 300 * (tensors_three - tensors_one)


@pytest.mark.parametrize("mesh,rules", [
    (fpp.Mesh(dp_shard=2, tp=2), fpp.Rules(fsdp="dp_shard", tp="tp")),
])
def test_native_trace_equals_the_dynamo_trace_and_eager(monkeypatch, mesh, rules):
    native = launch_steps(CFG, compile="aot_eager", mesh=mesh, rules=rules)
    eager = launch_steps(CFG, compile=False, mesh=mesh, rules=rules)
    monkeypatch.setenv("FPP_STEP_TRACE", "dynamo")
    dynamo = launch_steps(CFG, compile="aot_eager", mesh=mesh, rules=rules)
    for n, d, e in zip(native, dynamo, eager):
        assert_same_run(n, d, rtol=1e-6, atol=1e-6)
        assert_same_run(n, e, rtol=1e-5, atol=1e-5)


def _scaled_by_rank(params, batch):
    loss = llama.loss(params, batch, cfg=CFG)
    return loss * float(fpp.current_rank() + 1)        # a device-dependent constant in the graph


def test_a_trace_that_reads_the_rank_gets_a_graph_per_device_and_one_that_does_not_one_for_all():
    mesh, rules = fpp.Mesh(dp_replicate=2), fpp.Rules()
    batch = {k: v.data for k, v in make_batch(CFG, batch=2, seq=8).items()}

    def run(loss_fn, compile):
        step = fpp.train_step(loss_fn, fpp.optim.sgd(0.1), mesh=mesh, rules=rules, compile=compile)

        def device():
            state = step.init(fpp.init(llama.init, CFG, torch.float32, mesh=mesh, rules=rules, seed=0))
            return [float(step(state, batch)[1]["loss"]) for _ in range(2)]
        return fpp.launch(device, mesh, timeout=600), step
    plain = functools.partial(llama.loss, cfg=CFG)
    for loss_fn, graphs in ((_scaled_by_rank, 2), (plain, 1)):
        compiled, step = run(loss_fn, "aot_eager")
        eager, _ = run(loss_fn, False)
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-6, atol=1e-6)
        assert len({id(n) for n in step._natives.values()}) == graphs
    assert compiled[0] == compiled[1]      # (the plain loss: the same on both replicas)


def test_another_mesh_is_another_compilation_with_its_own_numbers():
    batch = {k: v.data for k, v in make_batch(CFG, batch=4, seq=8).items()}

    def losses(step, mesh):
        def run():
            state = step.init(fpp.init(llama.init, CFG, torch.float32, mesh=mesh, seed=0))
            local = {k: v.chunk(mesh.size)[fpp.current_rank()] for k, v in batch.items()}
            state, _ = step(state, local)
            return float(step(state, local)[1]["loss"])
        return fpp.launch(run, mesh, timeout=600)
    compiled, eager = (fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.sgd(0.1), compile=c)
                       for c in ("aot_eager", False))
    for mesh in (fpp.Mesh(), fpp.Mesh(dp_replicate=2)):    # DP: gradients all-reduced, a graph of its own
        torch.testing.assert_close(losses(compiled, mesh), losses(eager, mesh), rtol=1e-6, atol=1e-6)
    assert len(compiled._natives) == 2


def test_token_id_checks_are_raised_by_cached_calls_too():
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.sgd(0.1), compile="aot_eager")
    good = {k: v.data for k, v in make_batch(CFG, batch=2, seq=8).items()}
    bad = {**good, "tokens": good["tokens"].clone()}
    bad["tokens"][1, 3] = CFG.vocab + 5

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float32, seed=0))
        state, _ = step(state, good)                 # compiles
        with pytest.raises(TokenIdError, match=str(CFG.vocab + 5)):
            step(state, bad)                         # the cached graph
    fpp.launch(device, fpp.Mesh())
