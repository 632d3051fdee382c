"""DoRA with FSDP x TP on four real gloo processes equals the simulated run: the magnitudes
initialised from the sharded base (its norms over the split input features: a derived
all-reduce), the weight norms of every step derived the same way, the base frozen
(docs/adapters.md "DoRA")."""
import functools

import torch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.models import llama

CFG = llama.Config.tiny(layers=1)
DORA = adapters.LoraConfig(r=4, alpha=8, target_linear=True, dora=True)
MESH = fpp.Mesh(dp_shard=2, tp=2)
RULES = llama.default_rules()
DATA = torch.randint(0, CFG.vocab, (8, 17), generator=torch.Generator().manual_seed(0))


def _device():
    decls = adapters.init(llama.init(CFG, torch.float64), DORA)
    step = fpp.train_step(adapters.adapt(functools.partial(llama.loss, cfg=CFG), DORA), fpp.optim.adamw(1e-2),
                          mesh=MESH, rules=RULES, trainable=adapters.trainable(DORA))
    with fpp.use_rules(RULES):
        batch = {"tokens": fpp.named(DATA[:, :-1], "batch seq").data,
                 "labels": fpp.named(DATA[:, 1:], "batch seq").data}
        params = adapters.init_magnitudes(fpp.init(lambda: decls, mesh=MESH, rules=RULES, seed=0), DORA)
    state = step.init(params)
    losses = []
    for _ in range(2):          # (B starts at zero: the second step moves A and the norms)
        state, m = step(state, batch)
        losses.append(m["loss"])
    with fpp.use_rules(RULES):
        start = fpp.gather_tree(params, decls, RULES)
        full = fpp.gather_tree(state["params"], decls, RULES)
    return losses, {p: x.numpy() for p, x in fpp.leaves_with_paths(full)}, {
        p: x.numpy() for p, x in fpp.leaves_with_paths(start)}


def test_dora_fsdp_tp_on_gloo_processes_equals_simulation():
    real = fpp.launch(_device, MESH, processes=True, timeout=300)
    sim = fpp.launch(_device, MESH)
    for (losses, params, start), (sim_losses, sim_params, _) in zip(real, sim):
        assert losses == sim_losses
        assert losses[-1] < losses[0]
        for p, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(sim_params[p]), rtol=1e-12, atol=1e-14)
            assert (x == start[p]).all() != (".lora." in p), p        # base frozen, adapters trained
        q = "layers.0.self_attn.lora.q_proj.lora_magnitude"        # peft's init: the rows' norms of W
        w = torch.from_numpy(start["layers.0.self_attn.q_proj"])
        torch.testing.assert_close(torch.from_numpy(start[q]), w.square().sum(0).sqrt(), rtol=1e-12, atol=0)
