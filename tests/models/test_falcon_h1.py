"""Falcon-H1 (``falcon_h1``) as a configuration of the one decoder (models/falcon_h1_hf.py,
models/mamba2.py): every layer a Mamba2 mixer and attention in parallel from one norm, then a SwiGLU
MLP, with every muP multiplier off 1 (embedding, the mixer's input / projections / output, the
attention's input / output, keys, the MLP's gate and output, logits). Tiny random models transformers
builds (the mixer's output gated without a norm, normed before the gate, or after it) load through
the HF import; logits, the fp64 loss and every gradient equal transformers'; export writes
``FalconH1ForCausalLM``, which loads with equal logits; LoRA on the attention and the MLP equals peft
(``in_proj``: our adapters of its parts, one exact PEFT adapter of the fused module); FSDP x TP with sequence parallelism on simulated devices and
FSDP x TP on real gloo processes equal one device."""
import pytest
import torch
from harness import (assert_export_round_trip, assert_hf_layout_equals_one_device, assert_lora_step_equals_peft,
                     assert_processes_equal_one_device, fp64_beside_hf, hf_scan_in_fp64, import_logits_beside_hf)

from functional_pp import adapters

peft = pytest.importorskip("peft")
from functional_pp.checkpoint import hf
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "FalconH1ForCausalLM"):
    pytest.skip("transformers without Falcon-H1", allow_module_level=True)

CONFIG = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head="auto", mamba_n_groups=2,
              mamba_d_state=8, mamba_chunk_size=4, embedding_multiplier=1.5, lm_head_multiplier=2.0,
              mlp_multipliers=[0.7, 1.3], key_multiplier=0.8, attention_in_multiplier=1.2,
              attention_out_multiplier=0.9, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6], ssm_in_multiplier=1.1,
              ssm_out_multiplier=0.7, pad_token_id=None, bos_token_id=None, eos_token_id=None)
NORMS = {"none": dict(mamba_rms_norm=False, mamba_n_groups=1),          # (one group, as the published ones)
         "before_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
         "gated": dict(mamba_rms_norm=True, mamba_norm_before_gate=False)}


@pytest.fixture(scope="module", params=sorted(NORMS))
def hf_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**{**CONFIG, **NORMS[request.param]}))
    with torch.no_grad():                       # the scan's and the norms' parameters off their initial values
        for n, p in model.named_parameters():
            if n.endswith(("A_log", "D", "dt_bias", "conv1d.bias")) or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    return out


def test_config_read(hf_dir):
    cfg = hf.config_from_hf(hf_dir)
    assert cfg.layer_blocks == ("mamba2|attention+mlp",) * 2 and cfg.mamba_norm == hf_dir.name[:-1]
    assert (cfg.mamba_part_multipliers, cfg.mlp_gate_multiplier, cfg.logit_scale) == ((0.5, 1.5, 0.8, 1.2, 0.6), 0.7,
                                                                                      2.0)


def test_logits_equal_transformers(hf_dir):
    model = transformers.FalconH1ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    import_logits_beside_hf(model, hf_dir)


def test_fp64_loss_and_every_gradient_equal_transformers(hf_dir, tmp_path):
    from safetensors.torch import load_file
    with hf_scan_in_fp64():
        model, cfg, loss, grads, out, want = fp64_beside_hf(hf_dir, "FalconH1ForCausalLM")
    # (transformers' rotary is float32 in a float64 model: float32's rounding there)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    want.backward()
    hf.save_hf_llama(grads, cfg, tmp_path / "grads")
    ours = load_file(str(tmp_path / "grads" / "model.safetensors"))
    theirs = {n: p.grad for n, p in model.named_parameters()}
    assert set(ours) == set(theirs)
    for name, g in ours.items():
        assert theirs[name].abs().max() > 0, name
        torch.testing.assert_close(g, theirs[name], rtol=1e-5, atol=1e-8, msg=lambda m, name=name: f"{name}: {m}")


def test_export_round_trip(hf_dir, tmp_path):
    assert_export_round_trip(hf_dir, tmp_path / "out", "falcon_h1", "FalconH1ForCausalLM")


def test_lora_on_attention_and_mlp_equals_peft(hf_dir):
    model = transformers.FalconH1ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert_lora_step_equals_peft(model, hf_dir, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])


def test_lora_on_in_proj_is_one_exact_peft_adapter(hf_dir, tmp_path):
    """``in_proj`` (Axolotl's target) is our adapters of its parts z, x, B, C, dt (as Phi-3's ``qkv_proj``);
    exported as one PEFT adapter of the fused module (A stacked, B block-diagonal), which peft loads on
    transformers' model with our logits (peft refuses ``out_proj`` / ``conv1d`` of Mamba models)."""
    import json

    import functional_pp as fpp
    from functional_pp.adapters import peft_dir
    from functional_pp.parallel import sharding
    cfg = hf.config_from_hf(hf_dir)
    lc = adapters.LoraConfig(r=2, alpha=4, target_modules=tuple(peft_dir.part_names(("in_proj", "q_proj"),
                                                                                    "falcon_h1")))
    assert set(lc.target_modules) == {"z_proj", "x_proj", "b_proj", "c_proj", "dt_proj", "q_proj"}
    decls = adapters.init(llama.init(cfg), lc)
    base = hf.load_hf_params(hf_dir, cfg)
    g = torch.Generator().manual_seed(1)
    lora = {p: {"lora_A": ab["lora_A"].data, "lora_B": 0.3 * torch.randn(ab["lora_B"].data.shape, generator=g)}
            for p, ab in adapters.split(fpp.init(lambda: decls, seed=0))[1].items()}
    tokens = torch.randint(0, cfg.vocab, (2, 12), generator=g)
    with torch.no_grad():
        ours = adapters.adapt(llama.forward, lc)(sharding.named_tree(adapters.joined(base, lora), decls),
                                                 fpp.wrap(tokens, "batch seq"), cfg).value()
        out = peft_dir.save_adapter(tmp_path / "adapter", lora, lc, str(hf_dir), base=base)
        conf = json.loads((out / "adapter_config.json").read_text())
        assert {"in_proj", "q_proj"} <= set(conf["target_modules"]) and "z_proj" not in conf["target_modules"]
        model = transformers.FalconH1ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        plain = model(input_ids=tokens).logits
        theirs = peft.PeftModel.from_pretrained(model, str(out)).eval()(input_ids=tokens).logits
        assert (theirs - plain).abs().max() > 1e-3                   # (the adapters act)
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_fsdp_tp_sp_equals_one_device(hf_dir):
    assert_hf_layout_equals_one_device(hf_dir, "fsdp_tp_sp")


def test_fsdp_tp_real_processes_equal_one_device(hf_dir):
    if hf_dir.name.startswith("gated"):        # (one launch per file)
        assert_processes_equal_one_device(hf.config_from_hf(hf_dir))
