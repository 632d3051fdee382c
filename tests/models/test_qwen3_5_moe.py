"""Qwen3.5-MoE (``qwen3_5_moe_text``; the multimodal ``qwen3_5_moe``'s text decoder): Qwen3.5's Gated
DeltaNet and gated-attention layers (tests/models/test_qwen3_5.py) with experts in every layer
(softmax top-k renormalised, a shared expert behind a sigmoid gate: models/moe.py). A tiny random
model transformers builds loads through the HF import (one tensor per expert in the files);
logits, loss and every gradient equal transformers'; export writes ``Qwen3_5MoeForCausalLM``, which
loads with equal logits; FSDP x TP with sequence parallelism and experts over ep on simulated
devices, and FSDP x TP on real gloo processes, equal one device."""
import dataclasses

import pytest
import torch
from harness import (assert_export_round_trip, assert_hf_layout_equals_one_device, assert_processes_equal_one_device,
                     fp64_beside_hf, import_logits_beside_hf, make_batch, our_logits, parallel, saved_hf_model,
                     single_device)

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip("transformers without Qwen3.5-MoE", allow_module_level=True)

CONFIG = dict(vocab_size=256, hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
              num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=6, layer_types=["linear_attention", "full_attention"], initializer_range=0.2,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=128)
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**CONFIG)).float().eval()
    return saved_hf_model(model, tmp_path_factory.mktemp("qwen3_5_moe_text"))


def test_config_reads_the_experts(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.experts, cfg.experts_top_k, cfg.moe_mlp, cfg.shared_expert_mlp) == (
        "qwen3_5_moe_text", 4, 2, 16, 24)
    assert (cfg.norm_topk_prob, cfg.shared_expert_gate, cfg.router_score, cfg.q_gate, cfg.linear_heads) == (
        True, True, "softmax", True, 4)


def test_import_logits_equal_transformers(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved, atol=3e-5)
    for change in (dict(norm_topk_prob=False), dict(experts_top_k=1)):      # (each matters)
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change


def test_loss_and_gradients_equal_transformers(saved):
    _, d = saved
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    fused = hf.save_hf_llama(grads, cfg, d.parent / "grads")
    from safetensors.torch import load_file
    files = load_file(str(fused / "model.safetensors"))
    theirs = {n: p.grad for n, p in model.named_parameters()}
    for name, g in theirs.items():          # (transformers holds the experts fused: gate_up_proj [E, 2F, H])
        if name.endswith("experts.gate_up_proj"):
            ours = torch.stack([torch.cat([files[f"{name[:-12]}{j}.{x}_proj.weight"] for x in ("gate", "up")])
                                for j in range(4)])
        elif name.endswith("experts.down_proj"):
            ours = torch.stack([files[f"{name[:-9]}{j}.down_proj.weight"] for j in range(4)])
        else:
            ours = files[name]
        torch.testing.assert_close(ours, g, rtol=1e-3, atol=1e-4 * g.abs().max().item(), msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", atol=5e-5,
                             **EAGER)


def test_layouts_equal_one_device(saved):
    """FSDP x TP with sequence parallelism, and the experts over ep (FSDP 2 x EP 2)."""
    assert_hf_layout_equals_one_device(saved[1], "fsdp_tp_sp")
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss, grads = single_device(cfg, params, batch)
    rules = fpp.Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard")
    p_loss, p_grads, _ = parallel(cfg, params, batch, fpp.Mesh(dp_shard=2, ep=2), rules)[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def test_fsdp_tp_on_real_processes_equal_one_device(saved):
    assert_processes_equal_one_device(hf.config_from_hf(saved[1]))
