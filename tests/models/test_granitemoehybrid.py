"""Granite 4's hybrid (``granitemoehybrid``) as a configuration of the one decoder
(models/granitemoehybrid_hf.py, models/mamba2.py): Granite's layers (embedding, residual, attention
and logit multipliers) whose token mixer is Mamba2 or attention, then the shared MLP and, where
``num_local_experts`` > 0, Granite MoE's experts. Tiny random models transformers builds (a dense one
with the rotary, one with experts and NoPE) load through the HF import; logits, the fp64 loss and
every gradient equal transformers'; export writes ``GraniteMoeHybridForCausalLM``, which loads with
equal logits; LoRA on the attention equals peft; FSDP x TP with sequence parallelism on simulated
devices and FSDP x TP on real gloo processes equal one device."""
import pytest
import torch
from harness import (assert_export_round_trip, assert_hf_layout_equals_one_device, assert_lora_step_equals_peft,
                     assert_processes_equal_one_device, fp64_beside_hf, hf_scan_in_fp64, import_logits_beside_hf)

from functional_pp.checkpoint import hf

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GraniteMoeHybridForCausalLM"):
    pytest.skip("transformers without Granite 4 hybrid", allow_module_level=True)

# Mamba2 (8 heads in 2 groups, chunks of 4), attention, Mamba2; multipliers off 1
CONFIG = dict(vocab_size=256, hidden_size=32, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
              num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, shared_intermediate_size=40,
              num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_head="auto",
              mamba_chunk_size=4, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
              logits_scaling=0.25, pad_token_id=None, bos_token_id=None, eos_token_id=None)
EAGER = dict(attn_implementation="eager", experts_implementation="eager")      # (float64 experts)
KINDS = {"dense_rope": dict(num_local_experts=0, position_embedding_type="rope"),
         "experts_nope": dict(num_local_experts=4, position_embedding_type=None)}


@pytest.fixture(scope="module", params=sorted(KINDS))
def hf_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**CONFIG,
                                                                                          **KINDS[request.param]))
    with torch.no_grad():                       # the scan's and the norms' parameters off their initial values
        for n, p in model.named_parameters():
            if n.endswith(("A_log", "D", "dt_bias", "conv1d.bias")) or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    return out


def test_config_read(hf_dir):
    cfg = hf.config_from_hf(hf_dir)
    assert cfg.layer_blocks == ("mamba2+mlp", "attention+mlp", "mamba2+mlp") and cfg.mamba_head_dim == 8
    assert (cfg.experts, cfg.nope_layers is None) in ((0, True), (4, False))


def test_logits_equal_transformers(hf_dir):
    model = transformers.GraniteMoeHybridForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    import_logits_beside_hf(model, hf_dir)


def test_fp64_loss_and_every_gradient_equal_transformers(hf_dir, tmp_path):
    from safetensors.torch import load_file
    with hf_scan_in_fp64():
        model, cfg, loss, grads, out, want = fp64_beside_hf(hf_dir, "GraniteMoeHybridForCausalLM", **EAGER)
    # (transformers' rotary and its router's softmax are float32 in a float64 model: float32's rounding there;
    # the Mamba2 layers alone are checked to float64's in test_nemotron_h.py and test_mamba2.py)
    rtol, atol = (1e-8, 1e-11) if cfg.nope_layers and not cfg.experts else (1e-5, 1e-8)
    torch.testing.assert_close(loss, want.detach(), rtol=rtol, atol=0)
    want.backward()
    hf.save_hf_llama(grads, cfg, tmp_path / "grads")
    ours = load_file(str(tmp_path / "grads" / "model.safetensors"))
    theirs = {n: p.grad for n, p in model.named_parameters()}
    renamed = {"experts.gate_up_proj": "input_linear.weight", "experts.down_proj": "output_linear.weight",
               "router.weight": "router.layer.weight"}          # (transformers' in-memory names of Granite MoE's)
    for old, new in renamed.items():
        theirs = {n.replace(f"block_sparse_moe.{old}", f"block_sparse_moe.{new}"): g for n, g in theirs.items()}
    assert set(ours) == set(theirs)
    for name, g in ours.items():
        assert theirs[name].abs().max() > 0, name
        torch.testing.assert_close(g, theirs[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def test_export_round_trip(hf_dir, tmp_path):
    assert_export_round_trip(hf_dir, tmp_path / "out", "granitemoehybrid", "GraniteMoeHybridForCausalLM")


def test_lora_on_attention_equals_peft(hf_dir):
    model = transformers.GraniteMoeHybridForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert_lora_step_equals_peft(model, hf_dir, ["q_proj", "k_proj", "v_proj", "o_proj"], layers=1)


def test_fsdp_tp_sp_equals_one_device(hf_dir):
    assert_hf_layout_equals_one_device(hf_dir, "fsdp_tp_sp")


def test_fsdp_tp_real_processes_equal_one_device(hf_dir):
    if "experts" in str(hf_dir):           # (one launch per file: the model with experts)
        assert_processes_equal_one_device(hf.config_from_hf(hf_dir))
