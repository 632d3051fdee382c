"""``optimizer: adamw_torch_4bit`` (Axolotl's name for torchao's ``AdamW4bit``) builds
``optim.adamw_4bit``: the first moment with the 4-bit signed dynamic map, the second with the
levels 1/16 .. 1, blocks of 128 with one absmax each, two codes a byte (even position in the
high nibble), Adam's update made from the new fp32 moments, decoupled weight decay. Checked
against torchao 0.18 on CPU (parameters to fp32 rounding; the packed codes and the scales are
torchao's), sharded state under FSDP against one device, and exact checkpoint resumption."""
from __future__ import annotations

import functools

import optree
import pytest
import torch

import functional_pp as fpp
from functional_pp.config import TrainConfig
from functional_pp.models import llama
from functional_pp.optim import Quantized4, ScaleByAdam8bitState
from tests.harness import make_batch

torchao_optim = pytest.importorskip("torchao.optim")

SHAPE = (16, 256)           # 4096 entries, whole blocks of 128: torchao quantizes it (>= 4096 entries)


def _ours(p0, grads, lr, wd):
    params = {"w": p0.clone()}
    opt = fpp.optim.adamw_4bit(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=wd)
    state = opt.init(params)
    for g in grads:
        upd, state = opt.update({"w": g}, state, params)
        params = {"w": params["w"] + upd["w"]}
    found = optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, ScaleByAdam8bitState), none_is_leaf=False)
    return params["w"], next(x for x in found if isinstance(x, ScaleByAdam8bitState))


def _torchao(p0, grads, lr, wd):
    p = torch.nn.Parameter(p0.clone())
    opt = torchao_optim.AdamW4bit([p], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


def test_adamw_torch_4bit_is_torchaos_adamw4bit():
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(SHAPE, generator=g)
    grads = [torch.randn(SHAPE, generator=g) for _ in range(4)]
    ours, state = _ours(p0, grads, 1e-2, 0.1)
    theirs, ao = _torchao(p0, grads, 1e-2, 0.1)
    assert (ours - p0).abs().max() > 1e-2                 # the steps moved the weights
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    for mine, theirs_q in ((state.mu["w"], ao["exp_avg"]), (state.nu["w"], ao["exp_avg_sq"])):
        assert isinstance(mine, Quantized4) and mine.codes.shape == (16, 128)   # two codes a byte
        same = (mine.codes.reshape(-1) == theirs_q.codes.reshape(-1)).float().mean()
        assert same > 0.995                                # fp32 rounding moves the odd value across a midpoint
        torch.testing.assert_close(mine.absmax.reshape(-1), theirs_q.scale, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("name", ["adamw_torch_4bit", "ao_adamw_4bit", "adamw_4bit"])
def test_config_names_build_adamw_4bit(name):
    from functional_pp.app.optimizer import optimizer_from_config
    cfg = TrainConfig.from_dict({"optimizer": name, "learning_rate": 1e-3})
    assert cfg.optimizer == "adamw_4bit"
    adam = optimizer_from_config(cfg)[0].init({"w": torch.zeros(8, 256)})[1]
    assert isinstance(adam.mu["w"], Quantized4)
    assert any("AdamW4bit" in n for n in cfg.notes) == (name != "adamw_4bit")


CFG = llama.Config.tiny(layers=1)
DATA = [make_batch(CFG, batch=2, seq=16, seed=i) for i in range(4)]
MESH = fpp.Mesh(dp_shard=2)
FSDP = fpp.Rules(batch="dp_shard", hidden="dp_shard")


def _train(mesh, rules):
    # blocks of 32: every leaf's last dimension stays a multiple of its block when FSDP halves `hidden`
    opt = fpp.optim.adamw_4bit(3e-3, weight_decay=0.1, block=32)
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), opt, mesh=mesh, rules=rules)
    decls = llama.init(CFG, torch.float64)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float64, mesh=mesh, rules=rules, seed=0))
        losses = []
        for b in DATA:
            with fpp.use_rules(rules):
                local = {k: fpp.named(v, "batch seq").data for k, v in b.items()}
            state, m = step(state, local)
            losses.append(m["loss"])
        with fpp.use_rules(rules):
            return losses, fpp.gather_tree(state["params"], decls, rules), state["opt_state"]
    return fpp.launch(device, mesh)


def test_fsdp_sharded_4bit_state_equals_one_device():
    want_losses, want_params, _ = _train(fpp.Mesh(), fpp.Rules())[0]
    for losses, params, opt_state in _train(MESH, FSDP):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-12, atol=0)
        for (path, x), (_, y) in zip(fpp.leaves_with_paths(params), fpp.leaves_with_paths(want_params)):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=lambda m: f"{path}: {m}")
        q = opt_state[0].mu["embed_tokens"]                # hidden-sharded: half the packed codes and scales
        assert isinstance(q, Quantized4) and q.codes.shape == (256, 16) and q.absmax.shape == (256, 1)


@pytest.mark.multiprocess
def test_fsdp_4bit_on_two_gloo_processes_equals_simulation():
    opt = fpp.optim.adamw_4bit(3e-3, weight_decay=0.1, block=32)
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), opt, mesh=MESH, rules=FSDP)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float32, mesh=MESH, rules=FSDP, seed=0))
        losses = []
        for b in DATA[:2]:
            with fpp.use_rules(FSDP):
                local = {k: fpp.named(v, "batch seq").data for k, v in b.items()}
            state, m = step(state, local)
            losses.append(m["loss"])
        return losses, [t.clone() for t in optree.tree_leaves(state["opt_state"])]
    real, simulated = fpp.launch(device, MESH, processes=True, timeout=300), fpp.launch(device, MESH)
    for (la, sa), (lb, sb) in zip(real, simulated):
        assert la == lb
        assert all(torch.equal(x, y) for x, y in zip(sa, sb))
