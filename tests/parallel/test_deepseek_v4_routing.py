"""DeepSeek-V4's routing (ops.experts) under expert parallelism. Its router scores
(``router_score="sqrtsoftplus"``): a tiny MoE decoder with sqrt(softplus) scores, the score
correction and renormalised top-2 of 4 experts equals one device in loss and every gradient with
the experts over their own ``ep`` axis x FSDP (simulated), and in two AdamW steps on two real gloo
processes (EP borrowed from dp_shard). Its hash routing (``chosen``, the experts given per token):
the op's output and gradients under EP x FSDP (simulated) and on two gloo processes equal one
device's. The op itself equals transformers' DeepseekV4SparseMoeBlock (tests/ops/test_experts.py)."""
import dataclasses

import pytest
import torch
from harness import assert_processes_equal_one_device, make_batch, parallel, single_device

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.core.layout import block_slices
from functional_pp.models import llama
from functional_pp.ops.experts import experts
from functional_pp.parallel import sharding
from functional_pp.parallel.named import settle

CFG = llama.Config.tiny(model_type="qwen3_moe", experts=4, experts_top_k=2, moe_mlp=32, norm_topk_prob=True,
                        router_score="sqrtsoftplus", router_bias=True)


def test_ep_x_fsdp_equals_one_device():
    full = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    batch = make_batch(CFG, batch=4, seq=8, seed=1)
    loss0, grads0 = single_device(CFG, full, batch)
    other, _ = single_device(dataclasses.replace(CFG, router_score="sigmoid"), full, batch)
    assert abs(other.item() - loss0.item()) > 1e-6                      # the score matters
    mesh, rules = fpp.Mesh(dp_shard=2, ep=2), Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard")
    for rank, (loss, grads, rep) in enumerate(parallel(CFG, full, batch, mesh, rules, report=True)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-9 * g0.abs().max().item(),
                                       msg=lambda m: f"rank {rank} {p}: {m}")
        assert rep.bytes("all_to_all") > 0                              # the tokens were dispatched


@pytest.mark.multiprocess
def test_gloo_processes_equal_one_device():
    assert_processes_equal_one_device(CFG, mesh=fpp.Mesh(dp_shard=2),
                                      rules=Rules(batch="dp_shard", experts="dp_shard", hidden="dp_shard"))


E, H, F_ = 4, 8, 16
DECLS = {"router": fpp.param((H, E), "hidden experts"), "gate": fpp.param((E, H, F_), "experts hidden mlp"),
         "up": fpp.param((E, H, F_), "experts hidden mlp"), "down": fpp.param((E, F_, H), "experts mlp hidden")}
FULL = tree.tree_map(lambda t: t.double(), fpp.init_params(DECLS, seed=0))
X = torch.randn(4, 4, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
CHOSEN = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(i))[:2]
                      for i in range(16)]).view(4, 4, 2)


def _hash_routed(mesh, rules, processes=False):
    def device():
        chosen = fpp.wrap(CHOSEN, "batch seq top_k")         # (outside the rules: whole, laid out as x by the op)
        with fpp.use_rules(rules):
            local = tree.tree_map(lambda t: t.clone().requires_grad_(),
                                  sharding.shard(FULL, DECLS, mesh, rules, fpp.current_rank()))
            p = sharding.named_tree(local, DECLS)
            out, _ = experts(fpp.named(X, "batch seq hidden"), p["router"], p["gate"], p["up"], p["down"], top_k=2,
                             normalize=True, score="sqrtsoftplus", weight_scale=1.5, clamp=(1.0, 0.4, 0.0),
                             chosen=chosen)
            (out.value() ** 2).sum().backward()
            grads = fpp.gather_tree(tree.tree_map(lambda t: t.grad, local), DECLS, rules)
            out = settle(out)
            return out.data, block_slices(tuple(X.shape), out.split, mesh, fpp.current_rank()), grads
    return fpp.launch(device, mesh, processes=processes)


@pytest.mark.multiprocess
def test_hash_routing_under_ep_equals_one_device():
    (want, _, grads0), = _hash_routed(fpp.Mesh(), Rules())
    ep_fsdp = (fpp.Mesh(dp_shard=2, ep=2), Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard"))
    gloo = (fpp.Mesh(dp_shard=2), Rules(batch="dp_shard", experts="dp_shard"))
    for (mesh, rules), processes in ((ep_fsdp, False), (gloo, True)):
        for out, region, grads in _hash_routed(mesh, rules, processes):
            torch.testing.assert_close(out, want[region], rtol=1e-12, atol=1e-12)
            for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
                torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=p)
