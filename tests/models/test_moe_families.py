"""Mixtral, Qwen3-MoE (a dense first layer: mlp_only_layers), Qwen2-MoE (a shared expert
with its sigmoid gate) and Granite MoE (Granite's multipliers; the experts one tensor each in the
files, gate and up fused along each expert's rows) as configurations of the one decoder (models/llama.py, models/moe.py):
tiny random models built by ``transformers`` from a config load through the HF import (the
per-expert tensors stacked along ``experts``); logits equal transformers'; the loss with the
auxiliary load-balancing loss (``output_router_logits``) and every gradient equal transformers'
in fp64; export writes the same class, which loads with equal logits; ``base_model``
dispatches on the model type; what the classes cannot hold is refused by name."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from harness import assert_export_round_trip, make_batch, our_logits, single_device, tokens

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, max_position_embeddings=128, output_router_logits=True, router_aux_loss_coef=0.1,
            num_experts_per_tok=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(BASE, intermediate_size=32, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        BASE, head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=4, norm_topk_prob=True,
        mlp_only_layers=[0])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        BASE, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        BASE, intermediate_size=32, num_local_experts=4, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.125, logits_scaling=4.0)),
}
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for family, (conf, cls, kw) in FAMILIES.items():
        torch.manual_seed(0)
        model = getattr(transformers, cls)(getattr(transformers, conf)(**kw)).float().eval()
        with torch.no_grad():              # O(1) logits, routers far from uniform
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        d = tmp_path_factory.mktemp(family)
        model.save_pretrained(d, safe_serialization=True)
        model.config._attn_implementation = model.config._experts_implementation = "eager"
        out[family] = (model, d)
    return out


def test_configs_read_each_family(saved):
    cfg = hf.config_from_hf(saved["mixtral"][1])
    assert (cfg.model_type, cfg.experts, cfg.experts_top_k, cfg.moe_mlp, cfg.norm_topk_prob) == ("mixtral", 4, 2, None,
                                                                                                 True)
    assert (cfg.router_aux_loss_coef, cfg.moe_layers, cfg.sliding_window) == (0.1, None, None)
    cfg = hf.config_from_hf(saved["qwen3_moe"][1])
    assert (cfg.qk_norm, cfg.mlp, cfg.moe_mlp, cfg.moe_layers, cfg.dim_head) == (True, 96, 32, (1,), 32)
    assert "router" not in llama.init(cfg)["layers"][0]["mlp"] and "router" in llama.init(cfg)["layers"][1]["mlp"]
    cfg = hf.config_from_hf(saved["qwen2_moe"][1])
    assert (cfg.qkv_bias, cfg.shared_expert_mlp, cfg.norm_topk_prob) == (True, 48, False)
    cfg = hf.config_from_hf(saved["granitemoe"][1])
    assert (cfg.experts, cfg.experts_top_k, cfg.moe_mlp, cfg.norm_topk_prob, cfg.embedding_multiplier,
            cfg.residual_multiplier, cfg.logit_scale) == (4, 2, None, True, 3.0, 0.5, 0.25)
    # the auxiliary loss counts only where transformers adds it (output_router_logits)
    conf = json.loads((saved["qwen3_moe"][1] / "config.json").read_text())
    assert hf.config_from_hf(dict(conf, output_router_logits=False)).router_aux_loss_coef == 0.0
    assert llama.Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_logits_equal_transformers(saved, family):
    model, d = saved[family]
    cfg, params = hf.load_hf_llama(d)
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    assert want.abs().max() > 0.5
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
    other = dataclasses.replace(cfg, experts_top_k=1)       # the routing matters
    assert not torch.allclose(our_logits(params, other, toks), want, atol=1e-3)


def _hf_grad(ours: dict, name: str, cfg) -> tuple[str, torch.Tensor]:
    """Our gradient of the in-memory transformers parameter ``name`` (its experts fused:
    ``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F])."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("experts.gate_up_proj"):
        g, u = ours[f"layers.{layer}.mlp.gate"], ours[f"layers.{layer}.mlp.up"]
        return torch.cat([g.transpose(1, 2), u.transpose(1, 2)], dim=1)
    if name.endswith("experts.down_proj"):
        return ours[f"layers.{layer}.mlp.down"].transpose(1, 2)
    files = {n: parts for n, parts in hf._file_tensors(llama.init(cfg), cfg)}
    legacy = (name.replace("mlp.gate.weight", "block_sparse_moe.gate.weight") if cfg.model_type == "mixtral" else
              name.replace("router.weight", "router.layer.weight") if cfg.model_type == "granitemoe" else name)
    return torch.cat([kind.to_hf(ours[p]) for p, kind, _ in files[legacy]])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_with_aux_and_gradients_equal_transformers(saved, family):
    _, d = saved[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, **EAGER)
    cfg, params = hf.load_hf_llama(d, dtype=torch.float64)
    assert cfg.router_aux_loss_coef == 0.1
    batch = make_batch(cfg, batch=3, seq=12, seed=2)
    loss, grads = single_device(cfg, params, batch)
    out = model(input_ids=batch["tokens"])
    want = F.cross_entropy(out.logits.reshape(-1, cfg.vocab), batch["labels"].reshape(-1)) + 0.1 * out.aux_loss
    want.backward()
    # (transformers' router softmax is float32 even in a float64 model; ours is float64)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    for name, p in model.named_parameters():
        torch.testing.assert_close(_hf_grad(ours, name, cfg), p.grad, rtol=1e-4,
                                   atol=1e-5 * p.grad.abs().max().item(), msg=lambda m: f"{name}: {m}")
    no_aux = single_device(dataclasses.replace(cfg, router_aux_loss_coef=0.0), params, batch)[0]
    assert abs((loss - no_aux).item() - 0.1 * out.aux_loss.item()) < 1e-6


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_round_trip_in_transformers(saved, tmp_path, family):
    assert_export_round_trip(saved[family][1], tmp_path / "out", family, FAMILIES[family][1], **EAGER)


def test_base_model_dispatches_and_refusals(saved, tmp_path):
    import yaml

    from functional_pp.config import TrainConfig, model_config
    _, d = saved["qwen3_moe"]
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"base_model": str(d), "micro_batch_size": 2, "sequence_len": 16}))
    model = model_config(TrainConfig.from_yaml(path))
    assert (model.model_type, model.experts, model.moe_layers) == ("qwen3_moe", 4, (1,))
    conf = json.loads((saved["mixtral"][1] / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF mixtral config: router_jitter_noise=0.1 is not supported"):
        hf.config_from_hf(dict(conf, router_jitter_noise=0.1))
    cfg = hf.config_from_hf(saved["mixtral"][1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'mixtral': norm_topk_prob=False has no "
                                                         r"MixtralForCausalLM equivalent"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, norm_topk_prob=False), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'mistral': experts=4 has no MistralForCausalLM"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="mistral"), tmp_path / "no")
    assert not (tmp_path / "no").exists()
    # a missing expert is named
    broken = tmp_path / "broken"
    broken.mkdir()
    from safetensors.torch import load_file, save_file
    d = saved["mixtral"][1]
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(ck.CheckpointError, match=r"experts of model.layers.0.block_sparse_moe.experts.w1.weight "
                                                 r"are not numbered 0\.\.2 with one shape: \[0, 1, 3\]"):
        hf.load_hf_llama(broken)


def test_granitemoe_expert_and_tensor_parallel_reads_equal_transformers(saved):
    """EP x TP (the experts over dp_shard, their ``mlp`` over tp): each device reads its experts'
    rows of gate and of up from Granite MoE's fused ``input_linear`` (parts along each expert's
    rows), and the logits of every device's block equal transformers'."""
    from functional_pp.core.layout import Rules, block_slices
    from functional_pp.parallel import sharding
    from functional_pp.parallel.named import settle
    model, d = saved["granitemoe"]
    cfg, _ = hf.load_hf_llama(d)
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    rules = Rules(batch="dp_shard", experts="dp_shard", heads="tp", kv_heads="tp", vocab="tp", mlp="tp")
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits

    def device():
        with fpp.use_rules(rules):
            _, local = hf.load_hf_llama(d)
            assert tuple(local["layers"][0]["mlp"]["up"].shape) == (2, 64, 16)      # its experts, its mlp columns
            with torch.no_grad():
                logits = settle(llama.forward(sharding.named_tree(local, llama.init(cfg)), fpp.named(toks, "batch seq"),
                                              cfg))
            region = block_slices(tuple(want.shape), logits.split, mesh, fpp.current_rank())
            torch.testing.assert_close(logits.data, want[region], atol=1e-5, rtol=1e-5)
    fpp.launch(device, mesh)
