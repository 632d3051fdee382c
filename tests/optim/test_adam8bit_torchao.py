"""``optimizer: adamw_torch_8bit`` (Axolotl's name for torchao's ``AdamW8bit``) builds
``optim.adamw_8bit``: the same algorithm (the dynamic 8-bit maps, signed for the first moment and
unsigned for the second, blocks of 256 with one absmax each, Adam's update made from the new fp32
moments, decoupled weight decay). Checked against torchao 0.18 on CPU: the parameters after a few
steps agree to fp32 rounding and the moments' codes and scales are torchao's."""
from __future__ import annotations

import optree
import pytest
import torch

import functional_pp as fpp
from functional_pp.config import TrainConfig
from functional_pp.optim import ScaleByAdam8bitState

torchao_optim = pytest.importorskip("torchao.optim")

SHAPE = (16, 256)           # 4096 entries, whole blocks of 256: torchao quantizes it (>= 4096 entries)


def _ours(p0, grads, lr, wd):
    params = {"w": p0.clone()}
    opt = fpp.optim.adamw_8bit(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=wd)
    state = opt.init(params)
    for g in grads:
        upd, state = opt.update({"w": g}, state, params)
        params = {"w": params["w"] + upd["w"]}
    found = optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, ScaleByAdam8bitState), none_is_leaf=False)
    return params["w"], next(x for x in found if isinstance(x, ScaleByAdam8bitState))


def _torchao(p0, grads, lr, wd):
    p = torch.nn.Parameter(p0.clone())
    opt = torchao_optim.AdamW8bit([p], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


def test_adamw_torch_8bit_is_torchaos_adamw8bit():
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(SHAPE, generator=g)
    grads = [torch.randn(SHAPE, generator=g) for _ in range(4)]
    ours, state = _ours(p0, grads, 1e-2, 0.1)
    theirs, ao = _torchao(p0, grads, 1e-2, 0.1)
    assert (ours - p0).abs().max() > 1e-2                 # the steps moved the weights
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    for mine, theirs_q in ((state.mu["w"], ao["exp_avg"]), (state.nu["w"], ao["exp_avg_sq"])):
        same = (mine.codes.reshape(-1) == theirs_q.codes.reshape(-1)).float().mean()
        assert same > 0.999                                # fp32 rounding moves the odd value across a midpoint
        torch.testing.assert_close(mine.absmax.reshape(-1), theirs_q.scale, rtol=1e-6, atol=0)


def test_config_names_map_to_adamw_8bit():
    for name in ("adamw_torch_8bit", "ao_adamw_8bit"):
        assert TrainConfig.from_dict({"optimizer": name}).optimizer == "adamw_8bit"
