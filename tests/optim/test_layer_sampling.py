"""LISA (``optim.sample_layers``; Axolotl's ``lisa_*`` keys): the layers drawn as Axolotl's LISA
callback draws them, the steps equal to ``torch.optim.AdamW`` on parameters whose
``requires_grad`` the callback switches (frozen layers: no gradient, no update, no decay, their
moments and step counts untouched), and every layout (DP, FSDP, TP; real gloo processes) equal
to one device."""
import functools

import numpy as np
import pytest
import torch

import functional_pp as fpp
from functional_pp import optim
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.optim.layer_sampling import lisa_draws, sample_layers
from functional_pp.parallel import sharding
from tests.harness import assert_processes_equal_one_device, launch_steps, make_batch

CFG = llama.Config(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, mlp=64)
N, INTERVAL, STEPS, LR, WD, CLIP = 2, 2, 6, 3e-3, 0.1, 0.05


def lisa_adamw(total_steps=STEPS):
    return optim.chain(sample_layers(optim.scale_by_adam(0.9, 0.95), n_layers=N, interval=INTERVAL,
                                     total_steps=total_steps, weight_decay=WD, mask=optim.decay_mask_by_ndim,
                                     clip_norm=CLIP),
                       optim.scale_by_learning_rate(LR))


def axolotl_draw(step, total_layers=CFG.layers, n_layers=N):
    """Axolotl's LISACallback.switch_active_layers, as written there."""
    np.random.seed(step)
    return sorted(np.random.choice(range(total_layers), n_layers, replace=False).tolist())


def test_the_draws_are_axolotls():
    table = lisa_draws(8, 3, 5, 40)
    for k in range(8):
        assert torch.nonzero(table[k]).flatten().tolist() == axolotl_draw(k * 5, 8, 3)


def torch_lisa_run(full):
    """The oracle: torch.optim.AdamW, the LISA callback switching requires_grad at every
    ``step % interval == 0``, gradients set to None between steps (the Trainer's zero_grad)."""
    decls = llama.init(CFG, torch.float64)
    params = tree.tree_map(lambda x: x.clone().requires_grad_(), full)
    flat = dict(fpp.leaves_with_paths(params))
    decayed = [p for k, p in flat.items() if p.ndim >= 2]
    plain = [p for k, p in flat.items() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": WD}, {"params": plain, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step in range(STEPS):
        if step % INTERVAL == 0:
            chosen = axolotl_draw(step)
            for k, p in flat.items():
                if k.startswith("layers."):
                    p.requires_grad_(int(k.split(".")[1]) in chosen)
        batch = make_batch(CFG, batch=4, seq=16, seed=step)
        named = sharding.named_tree(params, decls)
        loss = llama.loss(named, {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}, CFG).value()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in flat.values() if p.grad is not None], CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: p.detach() for k, p in flat.items()}


def initial_params():
    """The one device's initial parameters (the ones ``launch_steps`` starts from)."""
    return fpp.launch(lambda: tree.tree_map(lambda x: x.data.clone(), fpp.init(llama.init, CFG, torch.float64, seed=0)),
                      fpp.Mesh())[0]


@pytest.fixture(scope="module")
def one_device():
    return launch_steps(CFG, steps=STEPS, dtype=torch.float64, opt=lisa_adamw())[0]


def test_one_device_equals_torch_adamw_with_axolotls_callback(one_device):
    full = initial_params()
    losses, params = torch_lisa_run(full)
    torch.testing.assert_close(torch.tensor(one_device[0]), torch.tensor(losses), rtol=1e-12, atol=0)
    moved = set()
    for k, p in params.items():
        torch.testing.assert_close(torch.from_numpy(one_device[1][k]), p, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{k}: {m}")
        if not torch.equal(p, dict(fpp.leaves_with_paths(full))[k]):
            moved.add(k.split(".")[1] if k.startswith("layers.") else k)
    assert {"embed_tokens", "lm_head"} <= moved     # the rest trains at every step


def test_a_frozen_layer_is_untouched():
    full = initial_params()
    ran = launch_steps(CFG, steps=INTERVAL, dtype=torch.float64, opt=lisa_adamw(INTERVAL))[0][1]
    chosen = axolotl_draw(0)
    start = dict(fpp.leaves_with_paths(full))
    for k, x in ran.items():
        if k.startswith("layers."):
            same = np.array_equal(x, start[k].numpy())
            assert same == (int(k.split(".")[1]) not in chosen), k


@pytest.mark.parametrize("mesh, rules", [
    (fpp.Mesh(dp_replicate=2), fpp.Rules(batch="dp_replicate")),
    (fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard")),
    (fpp.Mesh(tp=2), llama.default_rules(fsdp=False)),
], ids=["dp", "fsdp", "tp"])
def test_layouts_equal_one_device(one_device, mesh, rules):
    for losses, params, _ in launch_steps(CFG, mesh=mesh, rules=rules, steps=STEPS, dtype=torch.float64,
                                          opt=lisa_adamw()):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_device[0]), rtol=1e-10, atol=0)
        for k, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one_device[1][k]), rtol=1e-8,
                                       atol=1e-12, msg=lambda m: f"{k}: {m}")


def test_gloo_processes_equal_one_device():
    assert_processes_equal_one_device(CFG, opt=lisa_adamw(2), mesh=fpp.Mesh(dp_shard=2))
