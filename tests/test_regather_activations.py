"""``configure(regather_activations=True)``: with sequence parallelism the projections keep
their sharded inputs and re-gather them in backward (Megatron); results are unchanged."""
import pytest
import torch

import functional_pp as fpp
from functional_pp import tree
from functional_pp.models import llama

from harness import local_batch, make_batch, single_device

CFG = llama.Config.tiny()
FULL = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
BATCH = make_batch(CFG, batch=4, seq=16)
MESH, RULES = fpp.Mesh(tp=2), llama.default_rules(fsdp=False, sequence_parallel=True)


def _step(regather: bool):
    decls = llama.init(CFG, torch.float64)

    def fn():
        with fpp.use_rules(RULES), fpp.configure(regather_activations=regather):
            local = tree.tree_map(lambda x: x.clone().requires_grad_(),
                                  tree.shard(FULL, decls, MESH, RULES, fpp.current_rank()))
            with fpp.comm_report() as rep:
                loss = llama.loss(tree.named_tree(local, decls), local_batch(BATCH, MESH, RULES), CFG).value()
                loss.backward()
            grads = tree.gather(tree.tree_map(lambda p: p.grad, local), decls, RULES)
        flat = {p: g.detach().numpy() for p, g in tree.leaves_with_paths(grads)}   # picklable by value
        return float(loss), flat, rep.count("all_gather", "tp")
    return fn


def _check(results):
    loss0, grads0 = single_device(CFG, FULL, BATCH)
    for loss, grads, _ in results:
        assert loss == pytest.approx(float(loss0), rel=1e-12)
        for path, g0 in tree.leaves_with_paths(grads0):
            torch.testing.assert_close(torch.from_numpy(grads[path]), g0, rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"{path}: {m}")


def test_regathered_inputs_give_the_same_gradients_and_regather_in_backward():
    plain = fpp.launch(_step(False), MESH)
    again = fpp.launch(_step(True), MESH)
    _check(plain)
    _check(again)
    # per layer q, k, v, gate and up re-gather their input, and the head its: 5 x layers + 1
    assert again[0][2] - plain[0][2] == 5 * CFG.layers + 1


@pytest.mark.multiprocess
def test_regathered_inputs_on_gloo_processes():
    _check(fpp.launch(_step(True), MESH, processes=True, timeout=120))
