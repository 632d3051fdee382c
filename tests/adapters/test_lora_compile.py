"""Compiled QLoRA and DoRA steps (``train_step(compile="aot_eager")``) equal the eager step:
the losses, the updated adapters and the untouched base under FSDP x 2 (simulated), compiled
once (no recompile between steps; DoRA one graph per device); the QLoRA base's codes stay bit-equal
(docs/adapters.md "Compiled steps")."""
import functools

import optree
import pytest
import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp._torch import cached_graph_count
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama
from functional_pp.models.quantize import quantize_linear_weights
from functional_pp.ops.loss import logits_widened_whole
from functional_pp.parallel import sharding
from functional_pp.quant.weights import QuantizedWeight
from functional_pp.step.native_trace import call_natively

CFG = llama.Config.tiny(layers=1)
CONFIGS = {"qlora": adapters.LoraConfig(r=4, alpha=8, target_linear=True),
           "dora": adapters.LoraConfig(r=4, alpha=8, target_linear=True, dora=True)}
DATA = [make_batch(CFG, batch=4, seq=8, seed=3)] * 2      # (one batch twice: the loss falls)
LAYOUTS = {"one": (fpp.Mesh(), fpp.Rules()), "fsdp": (fpp.Mesh(dp_shard=2), llama.default_rules(tp=False))}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _is_q(x):
    return isinstance(x, QuantizedWeight)


@functools.lru_cache(maxsize=None)
def _case(kind):
    decls = adapters.init(llama.init(CFG), CONFIGS[kind])
    g = torch.Generator().manual_seed(1)
    flat = {p: (0.1 * torch.randn(x.data.shape, generator=g) if p.endswith("lora_B") else x.data)
            for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=0))}
    full = map_with_path(lambda p, d: flat[p], decls)
    if kind == "dora":
        return full, decls
    return quantize_linear_weights(full, decls, "nf4", block=16, double_quant=False)


def _train(kind, layout, compile):
    params, decls = _case(kind)
    mesh, rules = LAYOUTS[layout]
    lc = CONFIGS[kind]
    loss = adapters.adapt(functools.partial(llama.loss, cfg=CFG), lc)
    step = fpp.train_step(loss, fpp.optim.adamw(1e-2), mesh=mesh, rules=rules, trainable=adapters.trainable(lc),
                          compile=compile)

    def device():
        with fpp.use_rules(rules):
            # (the shards are strided views; step.init makes its master copies contiguous, as the
            # updated parameters are: otherwise the second step recompiles for the new strides)
            local = sharding.shard(params, decls, mesh, rules, fpp.current_rank())
            state = step.init(adapters.init_magnitudes(sharding.named_tree(local, decls), lc))
        losses = []
        for b in DATA:
            with fpp.use_rules(rules):
                lb = {k: v.data for k, v in {k: fpp.named(v, "batch seq") for k, v in b.items()}.items()}
            with logits_widened_whole():        # (eager too the loss as a traced step computes it)
                state, m = step(state, lb)
            losses.append(float(m["loss"]))
        leaves = optree.tree_leaves(state["params"], is_leaf=_is_q, none_is_leaf=False)
        return losses, [x for leaf in leaves for x in (leaf if _is_q(leaf) else (leaf,)) if x is not None]
    return fpp.launch(device, mesh, timeout=1800)


# (a compile of a simulated step costs a minute or more on a small CPU: FSDP x 2 only, whose
# step holds the one-device step's ops and the gathers of the adapted weights besides; plain
# LoRA over float weights is QLoRA's path with a float base einsum, and DoRA's without the factor)
@pytest.mark.parametrize("kind, layout", [("qlora", "fsdp"), ("dora", "fsdp")])
def test_compiled_step_equals_eager(kind, layout):
    before = cached_graph_count(call_natively.__code__)      # (graphs other tests left cached)
    compiled = _train(kind, layout, "aot_eager")
    # both steps: no recompile. QLoRA: one graph for both devices; DoRA's weight norm slices the
    # gathered unit's A B to the weight's FSDP layout by rank, so each device traces its own
    graphs = cached_graph_count(call_natively.__code__) - before
    assert graphs == (1 if kind == "qlora" else 2), graphs
    eager = _train(kind, layout, False)
    for (losses, params), (losses0, params0) in zip(compiled, eager):
        assert losses[1] < losses[0]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses0), rtol=1e-6, atol=0)
        assert len(params) == len(params0)
        for a, b in zip(params, params0):
            a, b = getattr(a, "data", a), getattr(b, "data", b)
            if a.dtype.is_floating_point:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            else:                                   # the quantized base's codes: bit-equal
                assert torch.equal(a, b)
