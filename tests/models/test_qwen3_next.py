"""Qwen3-Next (``qwen3_next``): Qwen3.5's Gated DeltaNet and gated-attention layers
(tests/models/test_qwen3_5.py) with experts where its config puts them (here: a dense layer among
them, ``mlp_only_layers``) and its files' projections fused key head by key head
(``in_proj_qkvz``, ``in_proj_ba``). A tiny random model transformers builds loads through the HF
import (whole, and each device's heads under TP); logits, loss and every gradient equal
transformers'; export writes ``Qwen3NextForCausalLM``, which loads with equal logits; FSDP x TP with
sequence parallelism on simulated devices and FSDP x TP on real gloo processes equal one device."""
import pytest
import torch
from harness import (assert_export_round_trip, assert_hf_layout_equals_one_device, assert_processes_equal_one_device,
                     fp64_beside_hf, import_logits_beside_hf, saved_hf_model)

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3NextForCausalLM"):
    pytest.skip("transformers without Qwen3-Next", allow_module_level=True)

CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2, num_hidden_layers=3,
              mlp_only_layers=[1], norm_topk_prob=False, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
              layer_types=["linear_attention", "full_attention", "linear_attention"], initializer_range=0.2,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=128)
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**CONFIG)).float().eval()
    return saved_hf_model(model, tmp_path_factory.mktemp("qwen3_next"))


def test_config_reads_qwen3_next(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.experts, cfg.moe_layers, cfg.norm_topk_prob, cfg.mlp, cfg.moe_mlp) == (
        "qwen3_next", 4, (0, 2), False, 48, 16)
    assert (cfg.q_gate, cfg.linear_heads, cfg.linear_kv_heads, cfg.layer_types[1]) == (True, 4, 2, "full_attention")


def test_import_logits_equal_transformers(saved):
    import_logits_beside_hf(*saved, atol=5e-5)       # (float32: transformers sums in another order)


def test_each_device_reads_its_heads_of_the_fused_projections(saved):
    """Under TP 2 each device reads its key heads' rows of every part of ``in_proj_qkvz`` /
    ``in_proj_ba`` (group by group) and equals its shard of the whole tensors."""
    cfg, full = hf.load_hf_llama(saved[1])
    decls, mesh, rules = llama.init(cfg), fpp.Mesh(tp=2), llama.default_rules(fsdp=False)

    def device():
        with fpp.use_rules(rules):
            mine = hf.load_hf_params(saved[1], cfg)
            want = sharding.shard(full, decls, mesh, rules, fpp.current_rank())
        return mine, want
    for mine, want in fpp.launch(device, mesh):
        got = dict(tree.leaves_with_paths(mine))
        for path, w in tree.leaves_with_paths(want):
            assert torch.equal(got[path], w), path
        assert got["layers.0.linear_attn.in_proj_v"].shape == (32, 2, 6)


def test_loss_and_gradients_equal_transformers(saved):
    _, d = saved
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    files = hf.save_hf_llama(grads, cfg, d.parent / "grads")
    from safetensors.torch import load_file
    files = load_file(str(files / "model.safetensors"))
    for name, g in model.named_parameters():
        g = g.grad
        if name.endswith("experts.gate_up_proj"):       # (transformers holds the experts fused: [E, 2F, H])
            ours = torch.stack([torch.cat([files[f"{name[:-12]}{j}.{x}_proj.weight"] for x in ("gate", "up")])
                                for j in range(4)])
        elif name.endswith("experts.down_proj"):
            ours = torch.stack([files[f"{name[:-9]}{j}.down_proj.weight"] for j in range(4)])
        else:
            ours = files[name]
        torch.testing.assert_close(ours, g, rtol=1e-3, atol=1e-4 * g.abs().max().item(), msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "qwen3_next", "Qwen3NextForCausalLM", atol=5e-5,
                             **EAGER)


def test_fsdp_tp_sp_equals_one_device(saved):
    assert_hf_layout_equals_one_device(saved[1], "fsdp_tp_sp")


def test_fsdp_tp_on_real_processes_equal_one_device(saved):
    assert_processes_equal_one_device(hf.config_from_hf(saved[1]))
