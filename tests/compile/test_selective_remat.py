"""Selective activation checkpointing (``remat="selective"``, docs/memory.md): a layer keeps the
results of its matrix products and attention and recomputes the rest, eagerly and in a
compiled step. It changes no number (bitwise against no checkpointing on one device; within
float64 rounding on a composed mesh) and keeps less than no checkpointing and more than full
checkpointing: measured as the bytes a forward pass leaves allocated (eager) and the bytes a
compiled graph keeps for its backward (``saved_bytes``)."""
import functools

import pytest
import torch
from harness import local_batch, make_batch
from memtrack import window_peaks

import functional_pp as fpp
from functional_pp.compile.recompute import count_recomputed, saved_bytes
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding

from test_compile_step import run_step

MODES = (False, "selective", "selective_alternate", True)
CFG = llama.Config.tiny(layers=3)


def eager_forward_backward(mode, cfg=CFG):
    """One forward and backward of Llama on one device under ``remat=mode``: the loss, the
    gradients and the bytes the forward left allocated (what backward will read)."""
    decls = llama.init(cfg, torch.float32)
    full = fpp.init(llama.init, cfg, torch.float32, seed=0)
    batch = make_batch(cfg, batch=4, seq=32)

    def device():
        params = tree.tree_map(lambda x: x.data.detach().clone().requires_grad_(), full)
        named = sharding.named_tree(params, decls)
        b = {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}
        with fpp.configure(remat=mode), window_peaks() as w:
            with w.window():
                loss = llama.loss(named, b, cfg).value()
            loss.backward()
        return loss.detach(), tree.tree_map(lambda p: p.grad, params), w.retained[0]
    return fpp.launch(device, fpp.Mesh())[0]


def assert_equal_trees(a, b):
    for (path, x), (_, y) in zip(fpp.leaves_with_paths(a), fpp.leaves_with_paths(b)):
        assert torch.equal(x, y), path


def test_eager_selective_remat_is_exact_and_keeps_between_none_and_full():
    runs = {mode: eager_forward_backward(mode) for mode in MODES}
    loss, grads, _ = runs[False]
    for mode in ("selective", "selective_alternate", True):
        assert torch.equal(runs[mode][0], loss), mode
        assert_equal_trees(runs[mode][1], grads)
    kept = {mode: runs[mode][2] for mode in MODES}
    assert kept[False] > kept["selective"] > kept["selective_alternate"] > kept[True], kept
    # each layer keeps q, k, v, o, gate, up, down and attention's output: more than a third of
    # what no checkpointing keeps here, and several times full checkpointing's layer inputs
    assert kept["selective"] > 2 * kept[True], kept


@fpp.layer
def block(p, x):
    h = fpp.ops.einsum("rows d, d f -> rows f", x, p["w_in"])
    return x + fpp.ops.einsum("rows f, f d -> rows d", fpp.ops.silu(h) * h, p["w_out"])


def test_selective_remat_of_a_model_that_is_not_llama():
    """Any ``fpp.layer`` is checkpointed selectively, not only Llama's: the step trains as
    without checkpointing, bit for bit."""
    def loss_fn(params, batch):
        x = batch["x"]
        for p in params["blocks"]:
            x = block(p, x)
        return fpp.ops.mean(x * x, ("rows", "d"))

    def decls():
        return {"blocks": [{"w_in": fpp.param((8, 32), "d f", init="normal", scale=0.2, dtype=torch.float64),
                            "w_out": fpp.param((32, 8), "f d", init="normal", scale=0.2, dtype=torch.float64)}
                           for _ in range(2)]}
    x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def train(remat):
        step = fpp.train_step(loss_fn, fpp.optim.sgd(0.1), remat=remat, batch_dims={"x": "rows d"})

        def device():
            state = step.init(fpp.init(decls, seed=0))
            for _ in range(2):
                state, m = step(state, {"x": x})
            return m["loss"], state["params"]
        return fpp.launch(device, fpp.Mesh())[0]
    loss, params = train(False)
    for mode in ("selective", "selective_alternate"):
        loss_s, params_s = train(mode)
        assert loss_s == loss, mode
        assert_equal_trees(params_s, params)


def test_remat_modes_are_checked():
    with pytest.raises(ValueError, match="'selective'"):
        fpp.Policy(remat="full")
    with pytest.raises(ValueError, match="'selective'"):
        fpp.train_step(lambda p, b: p, fpp.optim.sgd(0.1), remat="op")
    assert fpp.Policy(remat="selective").remat == "selective"
    assert fpp.Policy(remat="selective_alternate").remat == "selective_alternate"
    with pytest.raises(ValueError, match="selective_alternate"):
        fpp.remat(lambda x: x, selective="alternate")


def test_selective_remat_with_per_layer_compilation_is_refused_by_name():
    step = fpp.train_step(functools.partial(llama.loss, cfg=llama.Config.tiny(layers=1)), fpp.optim.sgd(0.1),
                          compile="per_layer:aot_eager", remat="selective")

    def device():
        state = step.init(fpp.init(llama.init, llama.Config.tiny(layers=1), seed=0))
        step(state, make_batch(llama.Config.tiny(layers=1)))
    with pytest.raises(Exception, match="remat=.selective. with compile=.per_layer."):
        fpp.launch(device, fpp.Mesh())


@pytest.mark.slow
def test_compiled_selective_remat_is_exact_and_keeps_between_none_and_full():
    cfg = llama.Config.tiny(layers=2)
    runs = {mode: run_step(cfg, fpp.Mesh(), fpp.Rules(), compile="aot_eager", remat=mode)[0] for mode in MODES}
    eager = run_step(cfg, fpp.Mesh(), fpp.Rules(), remat="selective", loss_as_traced=True)[0]
    losses, params = runs[False][0], runs[False][4]
    for run in (runs["selective"], runs["selective_alternate"], runs[True], eager):
        assert run[0] == losses                                      # two steps' losses, bitwise
        assert_equal_trees(run[4], params)
    kept = {mode: saved_bytes(runs[mode][2][0]) for mode in MODES}
    assert kept[False] > kept["selective"] > kept["selective_alternate"] > kept[True], kept
    recomputed = {mode: count_recomputed(runs[mode][2][0]) for mode in MODES}
    assert recomputed[False] == 0 < recomputed["selective"] < recomputed["selective_alternate"] < recomputed[True], \
        recomputed


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, "aot_eager"])
@pytest.mark.parametrize("mode", ["selective", "selective_alternate"])
def test_selective_remat_under_fsdp_and_tp_equals_one_device(compile, mode):
    cfg = llama.Config.tiny(layers=1)
    ref = run_step(cfg, fpp.Mesh(), fpp.Rules(), dtype=torch.float64)[0]
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True)
    results = run_step(cfg, mesh, rules, dtype=torch.float64, compile=compile, remat=mode)
    if compile:
        assert all(count_recomputed(g) > 0 for r in results for g in r[2])
    for losses, _, _, _, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-6, atol=0)
        for (path, a), (_, b) in zip(fpp.leaves_with_paths(params), fpp.leaves_with_paths(ref[4])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=lambda m: f"{path}: {m}")


def _llama_step(mesh, rules, remat):
    """One SGD step of Llama in float64 on a device of ``mesh``: the loss and the gathered parameters."""
    cfg = llama.Config.tiny(layers=2)
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.sgd(0.1), mesh=mesh, rules=rules,
                          remat=remat)
    batch = make_batch(cfg, batch=4, seq=16, seed=0)

    def device():
        state = step.init(fpp.init(llama.init, cfg, torch.float64, mesh=mesh, rules=rules, seed=0))
        with fpp.use_rules(rules):
            local = {k: v.data for k, v in local_batch(batch, mesh, rules).items()}
        state, m = step(state, local)
        with fpp.use_rules(rules):
            full = fpp.gather_tree(state["params"], llama.init(cfg, torch.float64), rules)
        return float(m["loss"]), {path: p.detach().numpy() for path, p in fpp.leaves_with_paths(full)}
    return device


@pytest.mark.slow
def test_alternate_matmuls_on_gloo_processes_under_fsdp_and_tp_equals_one_device():
    """torchtitan's policy (``remat="selective_alternate"``) on real processes, each counting its
    own matrix products: the step is the one-device step without checkpointing."""
    one = fpp.launch(_llama_step(fpp.Mesh(), fpp.Rules(), False), fpp.Mesh())[0]
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    results = fpp.launch(_llama_step(mesh, llama.default_rules(sequence_parallel=True), "selective_alternate"),
                         mesh, processes=True, timeout=300)
    for loss, params in results:
        assert loss == pytest.approx(one[0], rel=1e-12)
        for path, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one[1][path]), rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"{path}: {m}")
