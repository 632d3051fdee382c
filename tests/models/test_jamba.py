"""Jamba (``jamba``) as a configuration of the one decoder (models/jamba_hf.py; its Mamba (v1) mixer
with the dt / B / C norms in models/mamba1.py): a tiny random ``JambaForCausalLM`` transformers
builds from a config (a Mamba layer with experts, an attention layer with the MLP, a Mamba layer
with the MLP) loads through the HF import; logits, the fp64 loss and every gradient equal
transformers'; export writes ``JambaForCausalLM``, which loads with equal logits; FSDP x TP with
sequence parallelism, EP and CP (CP 2, CP 2 x TP 2; plain and packed rows) on simulated devices and
FSDP x TP on real gloo processes equal one device; LoRA on every linear (Axolotl's ``lora_target_linear``) equals peft's ``all-linear``; QLoRA's
NF4 base equals transformers + bitsandbytes."""
import pytest
import torch
from harness import (assert_cp_equals_one_device, assert_export_round_trip, assert_hf_layout_equals_one_device, assert_lora_step_equals_peft,
                     assert_nf4_base_equals_bitsandbytes, assert_processes_equal_one_device, fp64_beside_hf,
                     hf_scan_in_fp64, import_logits_beside_hf, make_batch, parallel, saved_hf_model, single_device)

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "JambaForCausalLM"):
    pytest.skip("transformers without Jamba", allow_module_level=True)

# layers: Mamba + experts, attention + MLP, Mamba + MLP (attention every 3rd from 1, experts every 3rd from 0)
CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=3, expert_layer_offset=0,
              attn_layer_period=3, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=6, mamba_expand=2,
              initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None)
EAGER = dict(experts_implementation="eager", attn_implementation="eager")
LINEAR = ["in_proj", "x_proj", "dt_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
          "down_proj"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(transformers.JambaConfig(**CONFIG))
    out = tmp_path_factory.mktemp("jamba")
    saved_hf_model(model, out, perturb=("norm", "D", "conv1d.bias"))
    return out


def test_config_and_files_read(hf_dir):
    cfg, params = hf.load_hf_llama(hf_dir)
    assert cfg.layer_blocks == ("mamba1+mlp", "attention+mlp", "mamba1+mlp") and cfg.moe_layers == (0,)
    assert (cfg.experts, cfg.experts_top_k, cfg.norm_topk_prob, cfg.router_score) == (4, 2, False, "softmax")
    assert cfg.mamba1.dt_norms and (cfg.mamba1.inner, cfg.mamba1.dt_rank) == (64, 6)
    assert not any(cfg.rotates(i) for i in range(cfg.layers))              # (no positions anywhere)
    assert {"router", "gate", "up", "down"} <= set(params["layers"][0]["mlp"]) and "mamba1" in params["layers"][2]


def test_logits_equal_transformers(hf_dir):
    model = transformers.JambaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **EAGER).train()
    import_logits_beside_hf(model, hf_dir)


def test_fp64_loss_and_every_gradient_equal_transformers(hf_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    real_softmax = torch.nn.functional.softmax      # (the router's softmax in float32: kept in float64 here)
    monkeypatch.setattr(torch.nn.functional, "softmax", lambda x, dim=None, dtype=None, **kw: real_softmax(
        x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype, **kw))
    with hf_scan_in_fp64():
        model, cfg, loss, grads, out, want = fp64_beside_hf(hf_dir, "JambaForCausalLM", **EAGER)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
        want.backward()
    hf.save_hf_llama(grads, cfg, tmp_path / "grads")
    ours = load_file(str(tmp_path / "grads" / "model.safetensors"))
    theirs = {}
    for n, p in model.named_parameters():
        if n.endswith("experts.gate_up_proj"):           # (fused in transformers, one tensor per expert in files)
            for j in range(p.shape[0]):
                gate, up = p.grad[j].chunk(2, dim=0)
                theirs[n.replace("experts.gate_up_proj", f"experts.{j}.gate_proj.weight")] = gate
                theirs[n.replace("experts.gate_up_proj", f"experts.{j}.up_proj.weight")] = up
        elif n.endswith("experts.down_proj"):
            for j in range(p.shape[0]):
                theirs[n.replace("experts.down_proj", f"experts.{j}.down_proj.weight")] = p.grad[j]
        else:
            theirs[n] = p.grad
    assert set(ours) == set(theirs)
    for name, g in ours.items():
        assert theirs[name].abs().max() > 0, name
        torch.testing.assert_close(g, theirs[name], rtol=1e-8, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")


def test_export_round_trip(hf_dir, tmp_path):
    assert_export_round_trip(hf_dir, tmp_path / "out", "jamba", "JambaForCausalLM", **EAGER)


def test_fsdp_tp_sp_equals_one_device(hf_dir):
    assert_hf_layout_equals_one_device(hf_dir, "fsdp_tp_sp")


def test_cp_equals_one_device(hf_dir):
    """CP 2 and CP 2 x TP 2 (the Mamba layers' state handed from block to block, attention's ring),
    plain and packed rows (a document starting at a block's start): loss and every gradient equal one device's."""
    assert_hf_layout_equals_one_device(hf_dir, "cp")
    assert_cp_equals_one_device(hf_dir, lengths=(6, 7, 11))


def test_expert_parallel_x_tp_equals_one_device(hf_dir):
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss, grads = single_device(cfg, params, batch)
    rules = fpp.Rules(batch="dp_shard", experts="dp_shard", heads="tp", kv_heads="tp", mlp="tp", mamba_inner="tp")
    p_loss, p_grads, _ = parallel(cfg, params, batch, fpp.Mesh(dp_shard=2, tp=2), rules)[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m, path=path: f"{path}: {m}")


def test_fsdp_tp_real_processes_equal_one_device(hf_dir):
    assert_processes_equal_one_device(hf.config_from_hf(hf_dir))


def test_lora_on_every_linear_equals_peft(hf_dir):
    """Axolotl's ``lora_target_linear``: ours adapts the weights peft's ``all-linear`` does (the
    mixer's projections, attention's, the dense MLP's; not the router, the experts, the convolution
    or A_log), and one step of them equals peft's."""
    from functional_pp import adapters
    from functional_pp.adapters import lora
    from functional_pp.models import llama
    cfg = hf.config_from_hf(hf_dir)
    ours = lora.targets(llama.init(cfg), adapters.LoraConfig(target_linear=True))
    assert {p.rsplit(".", 1)[-1] for p in ours} == set(LINEAR) and len(ours) == 2 * 4 + 4 + 2 * 3
    model = transformers.JambaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **EAGER)
    # (transformers applies dt_proj by its weight, dt_proj.weight @ dt, where peft's adapter never acts, unless the
    # model is quantized (QLoRA, Axolotl's Jamba example): then it calls the module, as ours always does)
    model.config._is_quantized = True
    assert_lora_step_equals_peft(model, hf_dir, LINEAR, count=2 * len(ours))


def test_nf4_base_equals_transformers_with_bitsandbytes(tmp_path):
    """QLoRA's base: the mixer's in_proj, x_proj, dt_proj and out_proj, attention's and the MLP's
    projections quantized as bitsandbytes does (the experts' fused tensors and the router stay whole)."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    sizes = dict(CONFIG, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
                 mamba_dt_rank=64, mamba_d_state=16, initializer_range=0.1)
    model = transformers.JambaForCausalLM(transformers.JambaConfig(**sizes)).float().eval()
    model.config._experts_implementation = "eager"
    qp = assert_nf4_base_equals_bitsandbytes(model, tmp_path, **EAGER)
    mixer = qp["layers"][2]["mamba1"]
    assert {k for k, v in mixer.items() if type(v).__name__ == "QuantizedWeight"} == {
        "in_proj", "x_proj", "dt_proj", "out_proj"}


def test_refused_by_name(hf_dir):
    with pytest.raises(Exception, match=r"attention_dropout=0.1 is not supported"):
        hf.config_from_hf({**CONFIG, "model_type": "jamba", "attention_dropout": 0.1})
    import dataclasses
    cfg, params = hf.load_hf_llama(hf_dir)
    from functional_pp.models import llama_hf
    with pytest.raises(Exception, match=r"the attn layers \[0, 1\] are not every period-th layer"):
        llama_hf.config_to_hf(dataclasses.replace(cfg, layer_blocks=("attention+mlp", "attention+mlp", "mamba1+mlp")))
    with pytest.raises(Exception, match=r"mamba1_dt_norms=False has no JambaForCausalLM equivalent"):
        llama_hf.config_to_hf(dataclasses.replace(cfg, mamba1_dt_norms=False))
