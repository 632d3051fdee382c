"""Expert parallelism on real gloo processes equals the simulation: the uneven all-to-all
(rows kept, rows sent, none sent), forward and transpose, and a Qwen3-MoE-style decoder with
experts over ``ep``, which the batch uses too, and FSDP over it (loss and every gradient),
dropless and with a static capacity (``capacity_factor``: the even all-to-all of the slots,
assignments dropped), with a token capacity (``token_capacity``: each device's assignments per
expert capped before the dispatch) and with LoRA on the experts (adapters split with the experts)
and on the router. One launch of two processes."""
import pytest
import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.models import llama
from functional_pp.parallel import collectives as C
from functional_pp.parallel import sharding

pytestmark = pytest.mark.multiprocess

MESH = fpp.Mesh(ep=2)
RULES = Rules(batch="ep", experts="ep", hidden="ep")
CFG = llama.Config.tiny(model_type="qwen3_moe", qk_norm=True, experts=4, experts_top_k=2, moe_mlp=32,
                        norm_topk_prob=True, router_aux_loss_coef=0.1)
CAPACITY = llama.Config(**{**vars(CFG), "capacity_factor": 1.0, "router_z_loss_coef": 0.01})
TOKEN_CAPACITY = llama.Config(**{**vars(CFG), "token_capacity": 6})
LORA = adapters.LoraConfig(r=4, alpha=8, target_modules=("gate", "up", "down", "router"))
AXES = "ep"
SEND = [[2, 3], [0, 1]]                # rows device i sends to device j


def _device():
    i = C.axis_index(AXES)
    x = (torch.arange(sum(SEND[i]) * 3, dtype=torch.float64).reshape(-1, 3) + 100 * i).requires_grad_()
    y = C.all_to_all_v(x, AXES, SEND[i], [SEND[j][i] for j in range(2)])
    (y * torch.arange(1.0, y.shape[0] + 1, dtype=torch.float64)[:, None]).sum().backward()
    full = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    batch = make_batch(CFG, batch=4, seq=8, seed=1)
    losses, grads = [], {}
    for n, cfg in enumerate((CFG, CAPACITY, TOKEN_CAPACITY)):
        with fpp.use_rules(RULES):
            decls = llama.init(cfg, torch.float64)
            local = tree.tree_map(lambda t: t.clone().requires_grad_(),
                                  sharding.shard(full, decls, MESH, RULES, fpp.current_rank()))
            loss = llama.loss(sharding.named_tree(local, decls),
                              {k: fpp.named(v, "batch seq") for k, v in batch.items()}, cfg).value()
            loss.backward()
            gathered = fpp.gather_tree(tree.tree_map(lambda p: p.grad, local), decls, RULES)
        losses.append(loss.detach())
        grads.update({(n, p): g for p, g in tree.leaves_with_paths(gathered)})
    with fpp.use_rules(RULES):                  # LoRA on the experts and router: B not zero, so A gets a gradient
        decls = adapters.init(llama.init(CFG, torch.float64), LORA)
        whole = fpp.init(lambda: decls, seed=0)
        whole = tree.map_with_path(lambda p, x: x.data + 0.1 if p.endswith("lora_B") else x.data, whole)
        local = tree.tree_map(lambda t: t.clone().requires_grad_(),
                              sharding.shard(whole, decls, MESH, RULES, fpp.current_rank()))
        loss = adapters.adapt(llama.loss, LORA)(sharding.named_tree(local, decls),
                                                {k: fpp.named(v, "batch seq") for k, v in batch.items()}, CFG).value()
        loss.backward()
        gathered = fpp.gather_tree(tree.tree_map(lambda p: p.grad, local), decls, RULES)
    losses.append(loss.detach())
    grads.update({("lora", p): g for p, g in tree.leaves_with_paths(gathered) if ".lora." in p})
    return y.detach(), x.grad, torch.stack(losses), grads


def test_expert_parallelism_on_gloo_equals_simulation():
    real = fpp.launch(_device, MESH, processes=True, timeout=600)
    sim = fpp.launch(_device, MESH)
    for rank, ((y, gx, loss, grads), (y0, gx0, loss0, grads0)) in enumerate(zip(real, sim)):
        torch.testing.assert_close(y, y0, rtol=0, atol=0)
        torch.testing.assert_close(gx, gx0, rtol=0, atol=0)
        torch.testing.assert_close(loss, loss0, rtol=1e-13, atol=0)
        for p in grads0:
            torch.testing.assert_close(grads[p], grads0[p], rtol=1e-10, atol=1e-13, msg=lambda m: f"rank {rank} {p}: {m}")
    assert real[0][0].shape[0] == sum(SEND[j][0] for j in range(2))
    assert not torch.allclose(real[0][2][0], real[0][2][1])
    assert not torch.allclose(real[0][2][0], real[0][2][2])                     # the token capacity drops
    assert sum(k[0] == "lora" and sim[0][3][k].abs().max() > 0 for k in sim[0][3]) == 8 * CFG.layers   # A and B          # the capacity drops, the z-loss counts
