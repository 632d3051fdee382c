"""LoRA and DoRA with FSDP x TP on four real gloo processes equal the simulated run (one launch
trains both): the frozen base sharded and gathered per layer, the adapters trained; DoRA's
magnitudes initialised from the sharded base (its norms over the split input features: a
derived all-reduce), the weight norms of every step derived the same way (docs/adapters.md)."""
import functools

import pytest
import torch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.models import llama

pytestmark = pytest.mark.multiprocess

CFG = llama.Config.tiny(layers=1)
CONFIGS = {"lora": adapters.LoraConfig(r=4, alpha=8, target_linear=True),
           "dora": adapters.LoraConfig(r=4, alpha=8, target_linear=True, dora=True)}
MESH = fpp.Mesh(dp_shard=2, tp=2)
RULES = llama.default_rules()
DATA = torch.randint(0, CFG.vocab, (8, 17), generator=torch.Generator().manual_seed(0))


def _train(cfg: adapters.LoraConfig):
    """Two AdamW steps (B starts at zero: the second one moves A, and DoRA's norms): the losses,
    the gathered parameters at the start and at the end (numpy)."""
    decls = adapters.init(llama.init(CFG, torch.float64), cfg)
    step = fpp.train_step(adapters.adapt(functools.partial(llama.loss, cfg=CFG), cfg), fpp.optim.adamw(1e-2),
                          mesh=MESH, rules=RULES, trainable=adapters.trainable(cfg))
    with fpp.use_rules(RULES):
        batch = {"tokens": fpp.named(DATA[:, :-1], "batch seq").data,
                 "labels": fpp.named(DATA[:, 1:], "batch seq").data}
        params = adapters.init_magnitudes(fpp.init(lambda: decls, mesh=MESH, rules=RULES, seed=0), cfg)
    state = step.init(params)
    losses = []
    for _ in range(2):
        state, m = step(state, batch)
        losses.append(m["loss"])
    with fpp.use_rules(RULES):
        start, full = fpp.gather_tree(params, decls, RULES), fpp.gather_tree(state["params"], decls, RULES)
    return losses, *({p: x.numpy() for p, x in fpp.leaves_with_paths(t)} for t in (start, full))


def _device():
    return {name: _train(cfg) for name, cfg in CONFIGS.items()}


@pytest.fixture(scope="module")
def runs():
    return fpp.launch(_device, MESH, processes=True, timeout=300), fpp.launch(_device, MESH)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_adapters_with_fsdp_tp_on_gloo_processes_equal_simulation(runs, name):
    for real, sim in zip(*runs):
        (losses, start, params), (sim_losses, _, sim_params) = real[name], sim[name]
        assert losses == sim_losses
        assert losses[-1] < losses[0]
        for p, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(sim_params[p]), rtol=1e-12, atol=1e-14)
            assert (x == start[p]).all() != (".lora." in p), p        # base frozen, adapters trained
    if name == "dora":
        q = "layers.0.self_attn.lora.q_proj.lora_magnitude"           # peft's init: the rows' norms of W
        w = torch.from_numpy(start["layers.0.self_attn.q_proj"])
        torch.testing.assert_close(torch.from_numpy(start[q]), w.square().sum(0).sqrt(), rtol=1e-12, atol=0)
