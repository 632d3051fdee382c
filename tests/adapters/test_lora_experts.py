"""LoRA on the experts of a mixture of experts: the adapters carry the ``experts`` dimension
(one per expert, split by the rule that splits the experts); the adapted loss and the
adapters' gradients equal the merged-weight model's (``W + scale * A B`` per expert, by
autograd through the merge on plain tensors) and peft's (``target_parameters`` on transformers
5's fused expert parameters, gate and up sharing an A); EP (on ``ep`` x FSDP, x TP) equals one
device, dropless and with a capacity; LoRA on the router equals peft's on DBRX's router linear;
expert dropout, DoRA and the peft export are refused by name."""
import dataclasses

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


def _setup(cfg, lora=LORA):
    decls = adapters.init(llama.init(cfg, torch.float64), lora)
    g = torch.Generator().manual_seed(3)
    flat = {p: (0.2 * torch.randn(x.data.shape, generator=g, dtype=x.data.dtype) if p.endswith("lora_B") else x.data)
            for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=0))}
    return decls, map_with_path(lambda p, d: flat[p], decls)


def _adapted(cfg, decls, full, batch, mesh=None, rules=None, lora=LORA):
    """Per device the loss and the adapters' gathered gradients."""
    mesh, rules = mesh or fpp.Mesh(), rules or Rules()
    loss_fn = adapters.adapt(llama.loss, lora)

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


def test_dropout_dora_and_peft_export_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"DoRA \(use_dora\) on expert weight 'layers.0.mlp.router'"):
        adapters.init(llama.init(CFG), adapters.LoraConfig(r=4, alpha=8, dora=True, target_modules=("router",)))
    decls, full = _setup(CFG)
    batch = make_batch(CFG, batch=2, seq=8, seed=2)
    drop = adapters.LoraConfig(r=4, alpha=8, dropout=0.1, target_modules=("gate",))
    with pytest.raises(ValueError, match=r"lora_dropout > 0 on expert weights is not supported"):
        adapters.adapt(llama.loss, drop)(sharding.named_tree(full, decls),
                                          {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}, CFG)
    with pytest.raises(ValueError, match=r"adapts the experts .* export the merged model"):
        peft_dir.save_adapter(tmp_path / "a", adapters.split(full)[1], LORA)
    with pytest.raises(ValueError, match=r"DoRA \(use_dora\) on expert weight 'layers.0.mlp.gate' is not supported"):
        adapters.init(llama.init(CFG), adapters.LoraConfig(r=4, alpha=8, dora=True, target_modules=("gate",)))


def _peft_qwen3_moe(tmp_path):
    """A tiny transformers 5 Qwen3-MoE saved in ``tmp_path`` with peft's LoRA of its fused expert
    parameters (``target_parameters``; lora_B made nonzero), its loss on a batch and the
    gradients: ``(cfg, batch, loss, peft_param(i, proj, "A" | "B"))``."""
    peft = pytest.importorskip("peft")
    import torch.nn.functional as F
    import transformers

    from functional_pp.checkpoint import hf
    conf = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4,
                                       num_experts_per_tok=2, norm_topk_prob=True, intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(conf).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    model.save_pretrained(tmp_path)             # (the per-expert tensors of the HF files)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn_like(p))
    batch = make_batch(llama.Config.tiny(), batch=2, seq=8, seed=1)
    logits = pm(input_ids=batch["tokens"]).logits
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    want.backward()
    # peft nests the two wrappers: the first target (gate_up_proj) is experts.base_layer's adapter
    where = {"gate_up_proj": "mlp.experts.base_layer.lora_", "down_proj": "mlp.experts.lora_"}
    peft_ab = {n: p for n, p in pm.named_parameters() if "lora_" in n}

    def peft_param(i, proj, ab):
        return peft_ab[f"base_model.model.model.layers.{i}.{where[proj]}{ab}.default.weight"]
    return hf.config_from_hf(tmp_path), batch, want.detach(), peft_param


E, FM, R = 4, 16, 4


def _ours_from_peft(peft_param, i, proj, ab, grad=False):
    """peft's adapter tensor (or its gradient) in our layout: A (E, in, r), B (E, r, out)."""
    t = peft_param(i, proj, ab).grad if grad else peft_param(i, proj, ab).detach()
    return t.reshape(E, R, -1).transpose(1, 2) if ab == "A" else t.reshape(-1, R, E).permute(2, 1, 0)


def test_equals_peft_target_parameters_on_qwen3_moe(tmp_path):
    """peft's LoRA of transformers 5's fused expert parameters (``target_parameters``:
    ``mlp.experts.gate_up_proj`` [E, 2F, H], ``mlp.experts.down_proj`` [E, H, F]) is ours with
    gate and up sharing their A: the same adapters converted, the loss and every adapter
    gradient (A's as the sum of gate's and up's) equal peft's, fp32."""
    from functional_pp.checkpoint import hf
    cfg, batch, want, peft_param = _peft_qwen3_moe(tmp_path)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=("gate", "up", "down"))
    decls = adapters.init(llama.init(cfg), lc)
    lora = {}
    for i in range(2):
        a_gu, b_gu = _ours_from_peft(peft_param, i, "gate_up_proj", "A"), _ours_from_peft(peft_param, i, "gate_up_proj", "B")
        a_d, b_d = _ours_from_peft(peft_param, i, "down_proj", "A"), _ours_from_peft(peft_param, i, "down_proj", "B")
        for name, a, b in (("gate", a_gu, b_gu[..., :FM]), ("up", a_gu, b_gu[..., FM:]), ("down", a_d, b_d)):
            lora[f"layers.{i}.mlp.{name}"] = {"lora_A": a.contiguous(), "lora_B": b.contiguous()}
    full = adapters.joined(hf.load_hf_params(tmp_path, cfg), lora)
    ((loss, grads),) = _adapted(cfg, decls, full, batch)
    torch.testing.assert_close(loss.float(), want, rtol=1e-5, atol=1e-6)
    for i in range(2):
        def got(name, ab):
            return grads[f"layers.{i}.mlp.lora.{name}.lora_{ab}"]
        gu_a = _ours_from_peft(peft_param, i, "gate_up_proj", "A", grad=True)
        gu_b = _ours_from_peft(peft_param, i, "gate_up_proj", "B", grad=True)
        torch.testing.assert_close(got("gate", "A") + got("up", "A"), gu_a, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.cat([got("gate", "B"), got("up", "B")], -1), gu_b, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got("down", "A"), _ours_from_peft(peft_param, i, "down_proj", "A", grad=True),
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got("down", "B"), _ours_from_peft(peft_param, i, "down_proj", "B", grad=True),
                                   rtol=1e-4, atol=1e-6)


def test_lora_target_parameters_trains_peft_s_adapters(tmp_path):
    """Axolotl's ``lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]``
    builds peft's parametrization: gate and up hold one ``lora_A`` (up declares none and borrows
    gate's), so the trained tensors are peft's, their gradients equal peft's one for one (and an
    optimizer step moves them as peft's would); merging equals applying."""
    from functional_pp.checkpoint import hf
    from functional_pp.config import TrainConfig
    cfg, batch, want, peft_param = _peft_qwen3_moe(tmp_path)
    lc = TrainConfig.from_dict({"base_model": str(tmp_path), "adapter": "lora", "lora_r": 4, "lora_alpha": 8,
                                "lora_target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                "max_steps": 1}).lora_config()
    decls = adapters.init(llama.init(cfg), lc)
    mlp = decls["layers"][0]["mlp"]["lora"]
    assert set(mlp["gate"]) == {"lora_A", "lora_B"} and set(mlp["up"]) == {"lora_B"} and set(mlp["down"]) == {
        "lora_A", "lora_B"}
    lora = {}
    for i in range(2):
        b_gu = _ours_from_peft(peft_param, i, "gate_up_proj", "B")
        lora[f"layers.{i}.mlp.gate"] = {"lora_A": _ours_from_peft(peft_param, i, "gate_up_proj", "A").contiguous(),
                                        "lora_B": b_gu[..., :FM].contiguous()}
        lora[f"layers.{i}.mlp.up"] = {"lora_B": b_gu[..., FM:].contiguous()}
        lora[f"layers.{i}.mlp.down"] = {ab: _ours_from_peft(peft_param, i, "down_proj", ab[-1]).contiguous()
                                        for ab in ("lora_A", "lora_B")}
    full = adapters.joined(hf.load_hf_params(tmp_path, cfg), lora)
    loss_fn = adapters.adapt(llama.loss, lc)
    local = tree.tree_map(lambda t: t.clone().requires_grad_(), full)
    loss = loss_fn(sharding.named_tree(local, decls), {k: fpp.wrap(v, "batch seq") for k, v in batch.items()},
                   cfg).value()
    loss.backward()
    torch.testing.assert_close(loss.detach().float(), want, rtol=1e-5, atol=1e-6)
    grads = {p: t.grad for p, t in fpp.leaves_with_paths(local) if ".lora." in p}
    for i in range(2):
        torch.testing.assert_close(grads[f"layers.{i}.mlp.lora.gate.lora_A"],
                                   _ours_from_peft(peft_param, i, "gate_up_proj", "A", grad=True), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.cat([grads[f"layers.{i}.mlp.lora.gate.lora_B"],
                                              grads[f"layers.{i}.mlp.lora.up.lora_B"]], -1),
                                   _ours_from_peft(peft_param, i, "gate_up_proj", "B", grad=True), rtol=1e-4, atol=1e-6)
    merged = adapters.merge(full, lc)
    plain = llama.loss(sharding.named_tree(merged, llama.init(cfg)), {k: fpp.wrap(v, "batch seq")
                                                                        for k, v in batch.items()}, cfg).value()
    torch.testing.assert_close(plain.detach(), loss.detach(), rtol=1e-6, atol=1e-6)


def test_lora_target_parameters_refuses_other_tensors_by_name():
    from functional_pp.config import ConfigError, TrainConfig
    with pytest.raises(ConfigError, match=r"'self_attn.q_proj.weight' is not a mixture-of-experts tensor"):
        TrainConfig.from_dict({"model": {"preset": "tiny"}, "adapter": "lora", "lora_target_modules": ["q_proj"],
                               "lora_target_parameters": ["self_attn.q_proj.weight"]}).lora_config()
    with pytest.raises(ValueError, match=r"'layers.0.mlp.up' shares lora_A with 'layers.0.mlp.gate'"):
        adapters.init(llama.init(CFG), adapters.LoraConfig(target_modules=("up",), shared_a=(("gate", "up"),)))


def test_shared_a_under_ep_and_fsdp_equals_one_device():
    shared = adapters.LoraConfig(r=4, alpha=8, target_modules=("gate", "up", "down"), shared_a=(("gate", "up"),))
    decls, full = _setup(CFG, shared)
    batch = make_batch(CFG, batch=4, seq=8, seed=1)
    ((loss, grads),) = _adapted(CFG, decls, full, batch, lora=shared)
    assert "layers.0.mlp.lora.up.lora_A" not in grads and grads["layers.0.mlp.lora.gate.lora_A"].abs().max() > 0
    mesh, rules = LAYOUTS["ep_axis_x_fsdp"]
    for rank, (l, g) in enumerate(_adapted(CFG, decls, full, batch, mesh, rules, lora=shared)):
        torch.testing.assert_close(l, loss, rtol=1e-12, atol=0)
        for p in grads:
            torch.testing.assert_close(g[p], grads[p], rtol=1e-9, atol=1e-9 * grads[p].abs().max().item(),
                                       msg=f"rank {rank} {p}")


def test_lora_target_parameters_join_a_regex_of_lora_target_modules():
    from functional_pp.config import TrainConfig
    lc = TrainConfig.from_dict({"model": {"preset": "tiny", "experts": 4, "moe_mlp": 32}, "adapter": "lora",
                                "lora_target_modules": ".*q_proj", "max_steps": 1,
                                "lora_target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}).lora_config()
    found = adapters.targets(llama.init(llama.Config.tiny(experts=4, moe_mlp=32, layers=1)), lc)
    assert found == ["layers.0.mlp.down", "layers.0.mlp.gate", "layers.0.mlp.up", "layers.0.self_attn.q_proj"]
    assert lc.shared_a == (("gate", "up"),)


def test_router_lora_equals_peft_on_dbrx(tmp_path):
    """LoRA on the router (Axolotl's DBRX example targets ``layer``, DBRX's ``ffn.router.layer``
    nn.Linear): peft's adapter on that linear is ours on ``router`` (``hidden experts``, a plain
    linear: A ``hidden lora_r``, B ``lora_r experts``); the loss and the adapter gradients equal
    peft's in float64 (within HF's float32 attention softmax); EP and FSDP equal one device; the
    adapted router merges to the same loss and its PEFT directory loads into peft."""
    peft = pytest.importorskip("peft")
    import torch.nn.functional as F
    import transformers

    from functional_pp.checkpoint import hf
    conf = transformers.DbrxConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                                   attn_config=dict(kv_n_heads=2, clip_qkv=0.6, rope_theta=1000.0),
                                   ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))
    torch.manual_seed(0)
    model = transformers.DbrxForCausalLM(conf).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["layer"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn_like(p))
    batch = make_batch(llama.Config.tiny(), batch=4, seq=8, seed=1)
    logits = pm(input_ids=batch["tokens"]).logits
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    want.backward()
    peft_ab = {n: p for n, p in pm.named_parameters() if "lora_" in n}
    cfg = hf.config_from_hf(tmp_path)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=("router",))
    decls = adapters.init(llama.init(cfg, torch.float64), lc)
    assert decls["layers"][0]["mlp"]["lora"]["router"]["lora_B"].dims == ("lora_r", "experts")

    def peft_param(i, ab):
        return peft_ab[f"base_model.model.transformer.blocks.{i}.ffn.router.layer.lora_{ab}.default.weight"]
    lora = {f"layers.{i}.mlp.router": {"lora_A": peft_param(i, "A").detach().T.contiguous(),
                                       "lora_B": peft_param(i, "B").detach().T.contiguous()} for i in range(2)}
    full = adapters.joined(hf.load_hf_params(tmp_path, cfg, dtype=torch.float64), lora)
    ((loss, grads),) = _adapted(cfg, decls, full, batch, lora=lc)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)
    for i in range(2):
        for ab in "AB":
            want_g = peft_param(i, ab).grad.T
            torch.testing.assert_close(grads[f"layers.{i}.mlp.lora.router.lora_{ab}"], want_g, rtol=1e-5,
                                       atol=1e-6 * want_g.abs().max().item(), msg=f"layer {i} lora_{ab}")
    assert grads["layers.0.mlp.lora.router.lora_A"].abs().max() > 0
    for name, (mesh, rules) in LAYOUTS.items():
        for rank, (l, g) in enumerate(_adapted(cfg, decls, full, batch, mesh, rules, lora=lc)):
            torch.testing.assert_close(l, loss, rtol=1e-12, atol=0)
            for p in grads:
                torch.testing.assert_close(g[p], grads[p], rtol=1e-9, atol=1e-9 * grads[p].abs().max().item(),
                                           msg=f"{name} rank {rank} {p}")
    plain = llama.loss(sharding.named_tree(adapters.merge(full, lc), llama.init(cfg, torch.float64)),
                       {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}, cfg).value()
    torch.testing.assert_close(plain, loss, rtol=1e-12, atol=0)
    # the PEFT directory of our router adapters (DBRX's module name `layer`) loads into peft as its own
    out = peft_dir.save_adapter(tmp_path / "adapter", lora, lc, model_type="dbrx")
    fresh = transformers.DbrxForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    fresh.config._attn_implementation = "eager"
    loaded = peft.PeftModel.from_pretrained(fresh, out)
    torch.testing.assert_close(loaded(input_ids=batch["tokens"]).logits, logits.detach(), rtol=1e-12, atol=1e-12)


def test_router_lora_dropout_is_the_same_on_every_layout():
    """lora_dropout on the router's adapter (the DBRX example's 0.05): peft's ``dropout(x) A B``
    with the layout-free mask, so EP and FSDP equal one device, and it changes the loss."""
    lc = adapters.LoraConfig(r=4, alpha=8, dropout=0.3, target_modules=("router",))
    decls, full = _setup(CFG, lc)
    batch = make_batch(CFG, batch=4, seq=8, seed=2)
    ((loss, grads),) = _adapted(CFG, decls, full, batch, lora=lc)
    ((plain, _),) = _adapted(CFG, decls, full, batch, lora=dataclasses.replace(lc, dropout=0.0))
    assert abs(loss - plain) > 1e-6
    for name, (mesh, rules) in LAYOUTS.items():
        for rank, (l, g) in enumerate(_adapted(CFG, decls, full, batch, mesh, rules, lora=lc)):
            torch.testing.assert_close(l, loss, rtol=1e-12, atol=0, msg=f"{name} rank {rank}")
            for p in grads:
                torch.testing.assert_close(g[p], grads[p], rtol=1e-9, atol=1e-9 * grads[p].abs().max().item(),
                                           msg=f"{name} rank {rank} {p}")
