"""DoRA over a quantized base (QLoRA + ``peft_use_dora``): the weight norms and the magnitudes'
initialisation taken from the dequantized codes; two AdamW steps equal DoRA on the dequantized
base (one device), and FSDP x 2 equals them (docs/adapters.md "DoRA")."""
import functools

import optree
import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama
from functional_pp.models.quantize import quantize_linear_weights
from functional_pp.parallel import sharding
from functional_pp.quant.weights import QuantizedWeight, dequantize

CFG = llama.Config.tiny(layers=1)
LC = adapters.LoraConfig(r=4, alpha=8, target_linear=True, dora=True)
DATA = [make_batch(CFG, batch=4, seq=8, seed=3)] * 2


def _is_q(x):
    return isinstance(x, QuantizedWeight)


def _train(params, decls, mesh, rules):
    loss = adapters.adapt(functools.partial(llama.loss, cfg=CFG), LC)
    step = fpp.train_step(loss, fpp.optim.adamw(1e-2), mesh=mesh, rules=rules, trainable=adapters.trainable(LC))

    def device():
        with fpp.use_rules(rules):
            named = sharding.named_tree(sharding.shard(params, decls, mesh, rules, fpp.current_rank()), decls)
            state = step.init(adapters.init_magnitudes(named, LC))
        losses = []
        for b in DATA:
            with fpp.use_rules(rules):
                lb = {k: v.data for k, v in {k: fpp.named(v, "batch seq") for k, v in b.items()}.items()}
            state, m = step(state, lb)
            losses.append(float(m["loss"]))
        with fpp.use_rules(rules):
            return losses, adapters.split(fpp.gather_tree(state["params"], decls, rules))[1]
    return fpp.launch(device, mesh)


def test_qdora_equals_dora_on_the_dequantized_base():
    decls = adapters.init(llama.init(CFG), LC)
    g = torch.Generator().manual_seed(1)
    flat = {p: (0.1 * torch.randn(x.data.shape, generator=g) if p.endswith("lora_B") else x.data)
            for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=0))}
    full = map_with_path(lambda p, d: flat[p], decls)
    qp, qd = quantize_linear_weights(full, decls, "nf4", block=16, double_quant=False)
    dq = optree.tree_map(lambda x: dequantize(x) if _is_q(x) else x, qp, is_leaf=_is_q, none_is_leaf=False)
    ref = _train(dq, decls, fpp.Mesh(), fpp.Rules())[0]
    runs = [_train(qp, qd, fpp.Mesh(), fpp.Rules())[0]] + _train(qp, qd, fpp.Mesh(dp_shard=2),
                                                                 llama.default_rules(tp=False))
    assert ref[0][1] < ref[0][0] and len(ref[1]) == 7 * CFG.layers
    for losses, lora in runs:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=0)
        for p in ref[1]:
            assert ref[1][p].keys() == {"lora_A", "lora_B", "lora_magnitude"}
            for k in ref[1][p]:
                torch.testing.assert_close(lora[p][k], ref[1][p][k], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{p}.{k}: {m}")
