"""LoRA with FSDP x TP on four real gloo processes equals the simulated run: the frozen base
sharded and gathered per layer, the adapters trained (docs/adapters.md)."""
import functools

import torch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.models import llama

CFG = llama.Config.tiny()
LORA = adapters.LoraConfig(r=4, alpha=8, target_linear=True)
MESH = fpp.Mesh(dp_shard=2, tp=2)
RULES = llama.default_rules()
DATA = torch.randint(0, CFG.vocab, (8, 17), generator=torch.Generator().manual_seed(0))


def _device():
    decls = adapters.init(llama.init(CFG, torch.float64), LORA)
    step = fpp.train_step(adapters.adapt(functools.partial(llama.loss, cfg=CFG), LORA), fpp.optim.adamw(1e-2),
                          mesh=MESH, rules=RULES, trainable=adapters.trainable(LORA))
    with fpp.use_rules(RULES):
        batch = {"tokens": fpp.named(DATA[:, :-1], "batch seq").data, "labels": fpp.named(DATA[:, 1:], "batch seq").data}
    state = step.init(fpp.init(lambda: decls, mesh=MESH, rules=RULES, seed=0))
    # (B starts at zero: one step first, so that the next one's A gradients are not zero)
    losses = []
    for _ in range(2):
        state, m = step(state, batch)
        losses.append(m["loss"])
    with fpp.use_rules(RULES):
        full = fpp.gather_tree(state["params"], decls, RULES)
    return losses, {p: x.numpy() for p, x in fpp.leaves_with_paths(full)}


def test_lora_fsdp_tp_on_gloo_processes_equals_simulation():
    real = fpp.launch(_device, MESH, processes=True, timeout=300)
    sim = fpp.launch(_device, MESH)
    start = {p: x.data for p, x in fpp.leaves_with_paths(fpp.init(lambda: adapters.init(
        llama.init(CFG, torch.float64), LORA), seed=0))}
    for (losses, params), (sim_losses, sim_params) in zip(real, sim):
        assert losses == sim_losses
        assert losses[-1] < losses[0]
        for p, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(sim_params[p]), rtol=1e-12, atol=1e-14)
            assert torch.equal(torch.from_numpy(x), start[p]) != (".lora." in p), p   # base frozen
