"""``configure(regather_activations=True)``: with sequence parallelism the projections keep
their sharded inputs and re-gather them in backward (Megatron); results are unchanged, with
or without context parallelism, and when the gathered residual is in load-balanced order
(the re-gather replays the reorder; docs/layouts.md)."""
import pytest
import torch
from harness import local_batch, make_batch, single_device

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding

CFG = llama.Config.tiny()
FULL = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
BATCH = make_batch(CFG, batch=4, seq=16)
MESH, RULES = fpp.Mesh(tp=2), llama.default_rules(fsdp=False, sequence_parallel=True)
# the residual stream load-balanced over tp: every SP gather is followed by a reorder
BALANCED_RESIDUAL = RULES.replace(res_seq=fpp.balanced("tp"))
CP_MESH = fpp.Mesh(cp=2, tp=2)     # seq balanced over cp; the SP residual over (cp, tp)


def _step(regather: bool, mesh=MESH, rules=RULES):
    decls = llama.init(CFG, torch.float64)

    def fn():
        with fpp.use_rules(rules), fpp.configure(regather_activations=regather):
            local = tree.tree_map(lambda x: x.clone().requires_grad_(),
                                  sharding.shard(FULL, decls, mesh, rules, fpp.current_rank()))
            with fpp.comm_report() as rep:
                loss = llama.loss(sharding.named_tree(local, decls), local_batch(BATCH, mesh, rules), CFG).value()
                loss.backward()
            grads = fpp.gather_tree(tree.tree_map(lambda p: p.grad, local), decls, rules)
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


@pytest.mark.parametrize("mesh, rules", [(MESH, RULES), (CP_MESH, RULES), (MESH, BALANCED_RESIDUAL)],
                         ids=["tp", "cp-tp", "balanced-residual"])
def test_regathered_inputs_give_the_same_gradients_and_regather_in_backward(mesh, rules):
    plain = fpp.launch(_step(False, mesh, rules), mesh)
    again = fpp.launch(_step(True, mesh, rules), mesh)
    _check(plain)
    _check(again)
    # per layer q, k, v, gate and up re-gather their input, and the head its: 5 x layers + 1
    assert again[0][2] - plain[0][2] == 5 * CFG.layers + 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh, rules", [(MESH, RULES), (CP_MESH, RULES), (MESH, BALANCED_RESIDUAL)],
                         ids=["tp", "cp-tp", "balanced-residual"])
def test_regathered_inputs_on_gloo_processes(mesh, rules):
    _check(fpp.launch(_step(True, mesh, rules), mesh, processes=True, timeout=180))
