"""A composed layout on real gloo processes, eager and under torch.compile(fullgraph=True)."""
import numpy as np
import pytest
import torch
from harness import local_batch, make_batch, single_device

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding

pytestmark = pytest.mark.multiprocess

CFG = llama.Config.tiny()
FULL = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
BATCH = make_batch(CFG, batch=4, seq=16)


def _run(mesh, rules, compile_mode):
    decls = llama.init(CFG, torch.float64)

    def fn():
        torch._dynamo.reset()
        with fpp.use_rules(rules):
            local = tree.tree_map(lambda x: x.clone().requires_grad_(),
                                  sharding.shard(FULL, decls, mesh, rules, fpp.current_rank()))
            batch = local_batch(BATCH, mesh, rules)

            def step(params, tokens, labels):
                named = sharding.named_tree(params, decls)
                b = {"tokens": fpp.wrap(tokens, "batch seq"), "labels": fpp.wrap(labels, "batch seq")}
                return llama.loss(named, b, CFG).value()
            frames = 0
            if compile_mode:
                import torch._dynamo.testing as dynamo_testing
                counter = dynamo_testing.CompileCounterWithBackend(compile_mode)
                step = torch.compile(step, backend=counter, fullgraph=True)
            loss = step(local, batch["tokens"].data, batch["labels"].data)
            loss.backward()
            if compile_mode:
                frames = counter.frame_count
            grads = fpp.gather_tree(tree.tree_map(lambda p: p.grad, local), decls, rules)
        return loss.item(), {p: g.numpy() for p, g in tree.leaves_with_paths(grads)}, frames
    return fpp.launch(fn, mesh, processes=True, timeout=300)


@pytest.mark.parametrize("compile_mode", [None, "aot_eager"])
def test_fsdp_tp_on_four_gloo_processes(compile_mode):
    loss0, grads0 = single_device(CFG, FULL, BATCH)
    grads0 = dict(tree.leaves_with_paths(grads0))
    for loss, grads, frames in _run(fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(), compile_mode):
        assert loss == pytest.approx(loss0.item(), rel=1e-12)
        for p, g in grads.items():
            np.testing.assert_allclose(g, grads0[p].numpy(), rtol=1e-9, atol=1e-12, err_msg=p)
        if compile_mode:
            assert frames == 1          # one graph, no breaks
