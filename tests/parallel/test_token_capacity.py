"""The experts' token capacity (Axolotl's ``expert_parallel_token_capacity``) in the layouts of
expert parallelism: it caps each expert's assignments among one device's tokens, before the
dispatch, so a layout whose devices hold half the batch each equals one device run on each half
(loss and every gradient the mean of the halves', drops included), and a layout whose devices
all hold the whole batch (experts split over an axis the tokens do not use) equals one device."""
import pytest
import torch
from harness import make_batch, parallel, single_device

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.models import llama, moe
from functional_pp.parallel import sharding

CFG = llama.Config.tiny(model_type="qwen3_moe", experts=4, experts_top_k=2, moe_mlp=32, norm_topk_prob=True,
                        token_capacity=6)
TP = dict(heads="tp", kv_heads="tp", vocab="tp", mlp="tp")
HALVES = {      # each device holds half the batch
    "ep_borrows_dp_shard": (fpp.Mesh(dp_shard=2), Rules(batch="dp_shard", experts="dp_shard")),
    "ep_replicated_batch_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2), Rules(batch="dp_shard", experts="ep",
                                                                     hidden="dp_shard")),
    "ep_x_tp": (fpp.Mesh(dp_shard=2, tp=2), Rules(batch="dp_shard", experts="dp_shard", **TP)),
}
WHOLE = (fpp.Mesh(ep=2), Rules(experts="ep"))          # the batch whole on each device


@pytest.fixture(scope="module")
def data():
    full = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    return full, make_batch(CFG, batch=4, seq=8, seed=1)


def _dropped(full, batch, cfg=CFG):
    with moe.collect() as stats:
        llama.loss(sharding.named_tree(full, llama.init(cfg, torch.float64)),
                   {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}, cfg).value()
    return sum(s.dropped.value().item() for s in stats)


def _close(loss, grads, loss0, grads0, what):
    torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
    for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
        torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-9 * g0.abs().max().item(),
                                   msg=lambda m: f"{what} {p}: {m}")


@pytest.mark.parametrize("layout", list(HALVES))
def test_devices_holding_half_the_batch_equal_one_device_per_half(data, layout):
    full, batch = data
    halves = [{k: v[i * 2:(i + 1) * 2] for k, v in batch.items()} for i in range(2)]
    assert all(_dropped(full, h) > 0 for h in halves)                 # the cap binds on each half
    (l1, g1), (l2, g2) = (single_device(CFG, full, h) for h in halves)
    want_g = tree.tree_map(lambda a, b: (a + b) / 2, g1, g2)
    assert want_g["layers"][0]["mlp"]["router"].abs().max() > 1e-6          # kept pairs carry a gradient
    mesh, rules = HALVES[layout]
    for rank, (loss, grads, _) in enumerate(parallel(CFG, full, batch, mesh, rules)):
        _close(loss, grads, (l1 + l2) / 2, want_g, f"{layout} rank {rank}")


def test_devices_holding_the_whole_batch_equal_one_device(data):
    full, batch = data
    cfg = llama.Config(**{**vars(CFG), "token_capacity": 12})
    assert _dropped(full, batch, cfg) > 0
    loss0, grads0 = single_device(cfg, full, batch)
    assert grads0["layers"][0]["mlp"]["router"].abs().max() > 1e-6
    plain, _ = single_device(llama.Config(**{**vars(CFG), "token_capacity": None}), full, batch)
    assert abs(plain - loss0) > 1e-8
    for rank, (loss, grads, _) in enumerate(parallel(cfg, full, batch, *WHOLE)):
        _close(loss, grads, loss0, grads0, f"whole rank {rank}")
