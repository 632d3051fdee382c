"""QLoRA under FSDP on two real gloo processes equals the simulated run: the NF4 codes and scales
sharded and all-gathered as bytes, the adapters trained (docs/adapters.md "QLoRA")."""
import functools

import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama
from functional_pp.models.quantize import quantize_linear_weights
from functional_pp.parallel import sharding

CFG = llama.Config.tiny()
LORA = adapters.LoraConfig(r=4, alpha=8, target_linear=True)
MESH, RULES = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)
BATCH = make_batch(CFG, batch=4, seq=8, seed=3)


def _device():
    decls = adapters.init(llama.init(CFG), LORA)
    flat = {p: x.data for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=0))}
    params, qdecls = quantize_linear_weights(map_with_path(lambda p, d: flat[p], decls), decls, "nf4", block=16,
                                             double_quant=True)   # (scales one block per row: kept whole)
    step = fpp.train_step(adapters.adapt(functools.partial(llama.loss, cfg=CFG), LORA), fpp.optim.adamw(1e-2),
                          mesh=MESH, rules=RULES, trainable=adapters.trainable(LORA))
    with fpp.use_rules(RULES):
        local = sharding.shard(params, qdecls, MESH, RULES, fpp.current_rank())
        state = step.init(sharding.named_tree(local, qdecls))
        batch = {k: fpp.named(v, "batch seq").data for k, v in BATCH.items()}
    losses = []
    for _ in range(2):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    with fpp.use_rules(RULES):
        lora = adapters.split(fpp.gather_tree(state["params"], qdecls, RULES))[1]
    return losses, {f"{p}.{k}": ab[k].numpy() for p, ab in lora.items() for k in ab}


def test_qlora_fsdp_on_gloo_processes_equals_simulation():
    real = fpp.launch(_device, MESH, processes=True, timeout=300)
    sim = fpp.launch(_device, MESH)
    for (losses, lora), (sim_losses, sim_lora) in zip(real, sim):
        assert losses == sim_losses and losses[-1] < losses[0]
        assert lora.keys() == sim_lora.keys() and len(lora) == 2 * 7 * CFG.layers
        for p, x in lora.items():
            assert (x == sim_lora[p]).all(), p
