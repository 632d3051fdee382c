"""Kimi Linear (``kimi_linear``: ``KimiLinearForCausalLM``) as a configuration of the one decoder
(models/kimi_delta.py, models/kimi_linear_hf.py): Kimi Delta Attention layers (the gated delta rule
with a decay per key channel) beside latent attention layers without rotary, DeepSeek-V3's experts
after a dense first layer. A tiny random model transformers builds from a config loads through the
HF import (the published checkpoint's names); logits, loss and every gradient equal transformers';
export writes ``KimiLinearForCausalLM``, which loads with equal logits; packed documents each equal
transformers on that document alone; LoRA on Axolotl's targets equals peft; FSDP x TP with sequence
parallelism and the experts over ep on simulated devices, FSDP x TP on real gloo processes, equal one
device; 8-bit / NF4 bases equal bitsandbytes; CP and the k/v cache are refused by name."""
import copy
import dataclasses
import json

import pytest
import torch
from harness import (assert_export_round_trip, assert_hf_layout_equals_one_device, assert_lora_step_equals_peft,
                     assert_processes_equal_one_device, fp64_beside_hf, import_logits_beside_hf, make_batch,
                     our_logits, parallel, single_device, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "KimiLinearForCausalLM"):
    pytest.skip("transformers without Kimi Linear", allow_module_level=True)

# a delta-attention layer, a latent-attention layer, a delta-attention layer; a dense first MLP, then experts
# (4 in 2 groups, the best group chosen, 2 per token, a shared expert)
CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
              qk_nope_head_dim=8, v_head_dim=6, n_group=2, topk_group=1, num_experts_per_tok=2, num_local_experts=4,
              n_shared_experts=1, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"], initializer_range=0.2, routed_scaling_factor=1.5,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=128)
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


def _as_published(d) -> None:
    """The dense layers' MLP under ``mlp.`` as in the published checkpoint (transformers' save writes
    every layer's under ``block_sparse_moe.``; it reads either)."""
    from safetensors.torch import load_file, save_file
    f = d / "model.safetensors"
    files = load_file(str(f))
    save_file({k.replace("block_sparse_moe.", "mlp.") if ".experts." not in k and ".gate." not in k
               and "shared_experts" not in k else k: v for k, v in files.items()}, str(f), metadata={"format": "pt"})


def _build(conf, seed=0):
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**conf)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:        # (so that the correction changes the choice)
                b.copy_(0.1 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _build(CONFIG)
    d = tmp_path_factory.mktemp("kimi_linear")
    model.save_pretrained(d, safe_serialization=True)
    _as_published(d)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    return model, d


def test_config_reads_kimi_linear(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.layer_types, cfg.nope_layers, cfg.moe_layers) == (
        "kimi_linear", ("kimi_delta_attention", "full_attention", "kimi_delta_attention"), (0, 1, 2), (1, 2))
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        16, None, 8, 4, 6)
    assert (cfg.experts, cfg.experts_top_k, cfg.moe_mlp, cfg.shared_expert_mlp, cfg.router_groups,
            cfg.router_topk_groups, cfg.routed_scaling_factor, cfg.router_score, cfg.router_bias) == (
        4, 2, 16, 16, 2, 1, 1.5, "sigmoid", True)
    assert (cfg.linear_heads, cfg.linear_head_dim, cfg.linear_conv_kernel) == (4, 8, 4)
    decls = dict(tree.leaves_with_paths(llama.init(cfg)))
    assert decls["layers.0.kda.dt_bias"].shape == (4, 8) and decls["layers.0.kda.f_b_proj"].shape == (8, 4, 8)
    # the checkpoint's own spelling (linear_attn_config, attribute_map names, first_k_dense_replace)
    conf = {k: v for k, v in json.loads((saved[1] / "config.json").read_text()).items()
            if k not in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads",
                         "linear_conv_kernel_dim")}
    conf.update(linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 8, "num_heads": 4,
                                    "short_conv_kernel_size": 4}, first_k_dense_replace=1)
    assert hf.config_from_hf(conf) == cfg


def test_import_logits_equal_transformers(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved, atol=3e-5)
    for change in (dict(routed_scaling_factor=1.0), dict(norm_eps=1e-2), dict(nope_layers=None, rope_scaling=None)):
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change
    no_bias = copy.deepcopy(params)                              # (the score correction changes the choice)
    for i in (1, 2):
        no_bias["layers"][i]["mlp"]["router_bias"] = torch.zeros(4)
    assert not torch.allclose(our_logits(no_bias, cfg, toks), want, atol=1e-3)


def test_loss_and_gradients_equal_transformers(saved):
    """float64 (transformers computes the delta rule and the gated norm in float32: equal to its precision)."""
    _, d = saved
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    fused = hf.save_hf_llama(grads, cfg, d.parent / "grads")
    from safetensors.torch import load_file
    files = load_file(str(fused / "model.safetensors"))
    assert dict(tree.leaves_with_paths(grads))["layers.0.kda.A_log"].abs().max() > 0
    renames = (("mlp.shared_experts.", "block_sparse_moe.shared_experts."), ("self_attn.forget_gate.", "self_attn."),
               ("mlp.gate.", "block_sparse_moe.gate."))
    for name, g in ((n, p.grad) for n, p in model.named_parameters()):
        file = name
        for a, b in renames:
            file = file.replace(a, b)
        if name.endswith("experts.gate_up_proj"):    # (transformers holds the experts fused: gate_up_proj [E, 2F, H])
            pre = file.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.")
            ours = torch.stack([torch.cat([files[f"{pre}{j}.{w}.weight"] for w in ("w1", "w3")]) for j in range(4)])
        elif name.endswith("experts.down_proj"):
            pre = file.replace("mlp.experts.down_proj", "block_sparse_moe.experts.")
            ours = torch.stack([files[f"{pre}{j}.w2.weight"] for j in range(4)])
        elif name.endswith("self_attn.conv1d.weight"):
            ours = torch.cat([files[file.replace("conv1d", f"{x}_conv1d")] for x in "qkv"])
        else:
            ours = files[file]
        assert g.abs().max() > 0 or name.endswith("gate.weight"), name
        g = g.to(ours.dtype)                          # (transformers keeps dt_bias and the router in float32)
        torch.testing.assert_close(ours.reshape(g.shape), g, rtol=1e-3, atol=1e-4 * g.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "kimi_linear", "KimiLinearForCausalLM", atol=5e-5, **EAGER)
