"""DeepSeek-V4's router scores (``router_score="sqrtsoftplus"``, ops.experts) under expert
parallelism: a tiny MoE decoder with sqrt(softplus) scores, the score correction and renormalised
top-2 of 4 experts equals one device in loss and every gradient with the experts over their own
``ep`` axis x FSDP (simulated), and in two AdamW steps on two real gloo processes (EP borrowed from
dp_shard). The op itself equals transformers' DeepseekV4SparseMoeBlock (tests/ops/test_experts.py)."""
import dataclasses

import torch
from harness import assert_processes_equal_one_device, make_batch, parallel, single_device

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.models import llama

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


def test_gloo_processes_equal_one_device():
    assert_processes_equal_one_device(CFG, mesh=fpp.Mesh(dp_shard=2),
                                      rules=Rules(batch="dp_shard", experts="dp_shard", hidden="dp_shard"))
