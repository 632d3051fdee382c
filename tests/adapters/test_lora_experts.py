"""LoRA on the experts of a mixture of experts: the adapters carry the ``experts`` dimension
(one per expert, split by the rule that splits the experts), the adapted loss and the
adapters' gradients equal the merged-weight model's (``W + scale * A B`` per expert, by
autograd through the merge on plain tensors: transformers 5 fuses the experts into 3-D
parameters, whose peft adapter is another parametrization), EP (on ``ep`` x FSDP, x TP)
equals one device, dropless and with a capacity; the router, dropout and the peft export are
refused by name."""
import pytest
import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.adapters import peft_dir
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama
from functional_pp.parallel import sharding

CFG = llama.Config.tiny(model_type="qwen3_moe", experts=4, experts_top_k=2, moe_mlp=32, norm_topk_prob=True,
                        router_aux_loss_coef=0.1)
LORA = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "gate", "up", "down"))
LAYOUTS = {
    "ep_axis_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2), Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard")),
    "ep_x_tp": (fpp.Mesh(dp_shard=2, tp=2), Rules(batch="dp_shard", experts="dp_shard", heads="tp", kv_heads="tp",
                                                  vocab="tp", mlp="tp")),
}


def _setup(cfg):
    decls = adapters.init(llama.init(cfg, torch.float64), LORA)
    g = torch.Generator().manual_seed(3)
    flat = {p: (0.2 * torch.randn(x.data.shape, generator=g, dtype=x.data.dtype) if p.endswith("lora_B") else x.data)
            for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=0))}
    return decls, map_with_path(lambda p, d: flat[p], decls)


def _adapted(cfg, decls, full, batch, mesh=None, rules=None):
    """Per device the loss and the adapters' gathered gradients."""
    mesh, rules = mesh or fpp.Mesh(), rules or Rules()
    loss_fn = adapters.adapt(llama.loss, LORA)

    def device():
        with fpp.use_rules(rules):
            local = tree.tree_map(lambda t: t.clone().requires_grad_(), sharding.shard(full, decls, mesh, rules,
                                                                                        fpp.current_rank()))
            loss = loss_fn(sharding.named_tree(local, decls), {k: fpp.named(v, "batch seq") for k, v in batch.items()},
                           cfg).value()
            loss.backward()
            grads = fpp.gather_tree(tree.tree_map(lambda t: t.grad, local), decls, rules)
        return loss.detach(), {p: g for p, g in fpp.leaves_with_paths(grads) if ".lora." in p}
    return fpp.launch(device, mesh)


def test_adapters_carry_the_experts_dimension():
    decls = adapters.init(llama.init(CFG), LORA)
    lora = decls["layers"][0]["mlp"]["lora"]
    assert lora["gate"]["lora_A"].dims == ("experts", "hidden", "lora_r")
    assert lora["gate"]["lora_B"].dims == ("experts", "lora_r", "mlp")
    assert lora["down"]["lora_A"].dims == ("experts", "mlp", "lora_r") and lora["down"]["lora_A"].shape == (4, 32, 4)
    every = adapters.targets(llama.init(CFG), adapters.LoraConfig(target_linear=True))
    assert not any(p.endswith(("mlp.gate", "mlp.up", "mlp.down")) for p in every)     # all-linear leaves them


@pytest.mark.parametrize("capacity", [None, 1.0], ids=["dropless", "capacity"])
def test_equals_the_merged_weight_model_and_ep_equals_one_device(capacity):
    cfg = llama.Config(**{**vars(CFG), "capacity_factor": capacity})
    decls, full = _setup(cfg)
    batch = make_batch(cfg, batch=4, seq=8, seed=1)
    ((loss, grads),) = _adapted(cfg, decls, full, batch)
    # the oracle: the merged weights W + scale * A B built by plain torch, autograd to A and B
    base, lora = adapters.split(full)
    leaves = {p: {k: t.clone().requires_grad_() for k, t in ab.items()} for p, ab in lora.items()}
    merged = map_with_path(lambda p, w: w if p not in leaves else w + adapters.lora.delta(
        leaves[p]["lora_A"], leaves[p]["lora_B"], LORA.scale, per_expert="mlp" in p and "proj" not in p), base)
    want = llama.loss(sharding.named_tree(merged, llama.init(cfg, torch.float64)),
                      {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}, cfg).value()
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    for p, ab in leaves.items():
        for k, t in ab.items():
            mine = grads[p.rsplit(".", 1)[0] + ".lora." + p.rsplit(".", 1)[1] + "." + k]
            torch.testing.assert_close(mine, t.grad, rtol=1e-9, atol=1e-12, msg=f"{p}.{k}")
    assert grads["layers.0.mlp.lora.gate.lora_A"].abs().max() > 0
    for name, (mesh, rules) in LAYOUTS.items():
        for rank, (l, g) in enumerate(_adapted(cfg, decls, full, batch, mesh, rules)):
            torch.testing.assert_close(l, loss, rtol=1e-12, atol=0)
            for p in grads:
                torch.testing.assert_close(g[p], grads[p], rtol=1e-9, atol=1e-9 * grads[p].abs().max().item(),
                                           msg=f"{name} rank {rank} {p}")


def test_merge_equals_applying():
    decls, full = _setup(CFG)
    batch = make_batch(CFG, batch=2, seq=8, seed=2)
    ((loss, _),) = _adapted(CFG, decls, full, batch)
    merged = adapters.merge(full, LORA)
    plain = llama.loss(sharding.named_tree(merged, llama.init(CFG, torch.float64)),
                       {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}, CFG).value()
    torch.testing.assert_close(plain, loss, rtol=1e-12, atol=0)


def test_router_dropout_and_peft_export_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"'layers.0.mlp.router' .* is a mixture-of-experts router"):
        adapters.targets(llama.init(CFG), adapters.LoraConfig(target_modules=("router",)))
    decls, full = _setup(CFG)
    batch = make_batch(CFG, batch=2, seq=8, seed=2)
    drop = adapters.LoraConfig(r=4, alpha=8, dropout=0.1, target_modules=("gate",))
    with pytest.raises(ValueError, match=r"lora_dropout > 0 on expert weights is not supported"):
        adapters.adapt(llama.loss, drop)(sharding.named_tree(full, decls),
                                          {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}, CFG)
    with pytest.raises(ValueError, match=r"adapts the experts .* export the merged model"):
        peft_dir.save_adapter(tmp_path / "a", adapters.split(full)[1], LORA)
