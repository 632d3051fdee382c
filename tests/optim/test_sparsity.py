"""``optim.keep_zeros`` (sparse fine-tuning, llm-compressor's ConstantPruningModifier): the zeros of
the targeted weights stay exactly zero, and every other entry trains as llm-compressor's loop makes
it (``torch.optim.AdamW``, then ``weight *= mask`` after each optimizer step, the mask
``|w| > 1e-8`` taken from the loaded weights); FSDP x TP (simulated and real gloo processes) equal
one device."""
import functools
import re

import pytest
import torch

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding
from functional_pp.parallel.init import init_params
from harness import local_batch, make_batch

CFG = llama.Config(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, mlp=64)
TARGET = re.compile(r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")
LR, WD, STEPS = 1e-2, 0.1, 3


def targeted(path: str) -> bool:
    return TARGET.match(path) is not None


def sparse_params() -> dict:
    """Full fp64 parameters whose targeted weights are 2:4 sparse along their first dimension (a
    few of the dropped entries 1e-9, under the modifier's epsilon: zero after the first step)."""
    full = init_params(llama.init(CFG, torch.float64), seed=0)
    g = torch.Generator().manual_seed(1)

    def two_of_four(path, w):
        if not targeted(path):
            return w
        groups = w.reshape(w.shape[0] // 4, 4, -1)
        keep = torch.rand(groups.shape, generator=g).argsort(dim=1) < 2        # 2 of every 4
        tiny = torch.rand(groups.shape, generator=g) < 0.1
        return torch.where(keep, groups, tiny * 1e-9).reshape(w.shape)
    return tree.map_with_path(two_of_four, full)


def oracle(full: dict, data: list) -> tuple[list, dict]:
    """llm-compressor's loop: torch.optim.AdamW, then the targeted weights times their mask."""
    params = tree.tree_map(lambda x: x.clone().requires_grad_(), full)
    masks = {p: x.abs() > 10e-9 for p, x in tree.leaves_with_paths(params) if targeted(p)}
    leaves = dict(tree.leaves_with_paths(params))
    opt = torch.optim.AdamW(list(leaves.values()), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)
    decls, losses = llama.init(CFG, torch.float64), []
    for b in data:
        opt.zero_grad()
        loss = llama.loss(sharding.named_tree(params, decls), {k: fpp.wrap(v, "batch seq") for k, v in b.items()},
                          CFG).value()
        loss.backward()
        opt.step()
        with torch.no_grad():                 # (the modifier's OPTIM_POST_STEP)
            for p, m in masks.items():
                leaves[p].mul_(m)
        losses.append(loss.item())
    return losses, {p: x.detach() for p, x in leaves.items()}


def run(full, data, mesh, rules, opt, processes=False, **step_kw):
    loss = functools.partial(llama.loss, cfg=CFG)
    step = fpp.train_step(loss, opt, mesh=mesh, rules=rules, **step_kw)
    decls = llama.init(CFG, torch.float64)

    def device():
        with fpp.use_rules(rules):
            state = step.init(sharding.named_tree(sharding.shard(full, decls, mesh, rules, fpp.current_rank()), decls))
        losses = []
        for b in data:
            with fpp.use_rules(rules):
                state, m = step(state, {k: v.data for k, v in local_batch(b, mesh, rules).items()})
            losses.append(float(m["loss"]))
        with fpp.use_rules(rules):
            out = fpp.gather_tree(state["params"], decls, rules)
        return losses, {p: x.detach().clone() for p, x in tree.leaves_with_paths(out)}
    return fpp.launch(device, mesh, processes=processes, timeout=600)


def sparse_adamw():
    return fpp.optim.chain(fpp.optim.adamw(LR, weight_decay=WD), fpp.optim.keep_zeros(targeted))


@pytest.fixture(scope="module")
def case():
    full, data = sparse_params(), [make_batch(CFG, batch=4, seq=8, seed=i) for i in range(STEPS)]
    return full, data, oracle(full, data)


def assert_run(result, ref, full):
    losses, params = result
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-10, atol=0)
    for p, x in params.items():
        torch.testing.assert_close(x, ref[1][p], rtol=1e-8, atol=1e-12, msg=lambda m: f"{p}: {m}")
        if targeted(p):
            zeros = full_leaf(full, p).abs() <= 1e-8
            assert zeros.any() and (x[zeros] == 0).all(), p       # the zeros exactly zero
            assert (x[~zeros] != full_leaf(full, p)[~zeros]).all(), p   # the others trained


def full_leaf(full, path):
    return dict(tree.leaves_with_paths(full))[path]


def test_one_device_equals_llm_compressors_loop(case):
    full, data, ref = case
    assert_run(run(full, data, fpp.Mesh(), fpp.Rules(), sparse_adamw())[0], ref, full)


def test_without_it_the_zeros_move(case):
    """(the check above can fail: plain AdamW trains the zeros)"""
    full, data, _ = case
    _, params = run(full, data, fpp.Mesh(), fpp.Rules(), fpp.optim.adamw(LR, weight_decay=WD))[0]
    zeros = full_leaf(full, "layers.0.self_attn.q_proj").abs() <= 1e-8
    assert (params["layers.0.self_attn.q_proj"][zeros] != 0).all()


def test_fsdp_x_tp_equals_one_device_simulated_and_in_processes(case):
    full, data, ref = case
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()
    for result in run(full, data, mesh, rules, sparse_adamw()):
        assert_run(result, ref, full)
    for result in run(full, data, mesh, rules, sparse_adamw(), processes=True):
        assert_run(result, ref, full)


def test_compiled_fsdp_equals_one_device(case):
    full, data, ref = case
    for result in run(full, data, fpp.Mesh(dp_shard=2), llama.default_rules(tp=False), sparse_adamw(),
                      compile="aot_eager"):
        assert_run(result, ref, full)


def test_the_mask_is_sharded_with_its_weight():
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()
    full = sparse_params()
    decls = llama.init(CFG, torch.float64)

    def device():
        local = sharding.shard(full, decls, mesh, rules, fpp.current_rank())
        keep = fpp.optim.keep_zeros(targeted).init(local).keep
        return {p: (k.shape == local_leaf.shape, bool((k == (local_leaf.abs() > 1e-8)).all()) if targeted(p) else
                    bool(k.all()) and k.stride() == (0,) * k.dim())
                for (p, k), local_leaf in zip(tree.leaves_with_paths(keep), tree.tree_leaves(local))}
    for per_device in fpp.launch(device, mesh):
        assert all(same_shape and ok for same_shape, ok in per_device.values()), per_device


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="keep_zeros: epsilon=-1"):
        fpp.optim.keep_zeros(targeted, epsilon=-1)
    with pytest.raises(TypeError, match="targets must be callable"):
        fpp.optim.keep_zeros(["q_proj"])
