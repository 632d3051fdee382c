"""LoRA of Seed-OSS (q/k/v and output biases), Apertus (an xIELU MLP not gated, per-head q/k
norms) and Hunyuan dense (q/k norms after the rotary) against peft + transformers (the oracle),
as tests/adapters/test_lora_peft.py does for Llama, Qwen3, OLMo 2 and Cohere: the same initial
adapters (B nonzero), fp32: the loss, every adapter gradient and the adapters after one AdamW
step equal peft's; Apertus's adapters under every layout (DP, FSDP, TP, FSDP x TP, simulated)
equal one device."""
import pytest
import torch
import torch.nn.functional as F
from harness import assert_adapter_layouts_equal_one_device, make_batch, train_adapters

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.adapters import peft_dir
from functional_pp.checkpoint import hf
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=128, pad_token_id=None)
GATED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# family -> (config class, model class, config, the modules adapted)
FAMILIES = {
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(
        BASE, head_dim=32, attention_out_bias=True, attention_dropout=0.0, residual_dropout=0.0), GATED),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(
        BASE, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
        ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(BASE, head_dim=16), GATED),
}
LR, WD = 1e-2, 0.1


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    family = request.param
    conf, cls, kw, targets = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, conf)(**kw)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    d = tmp_path_factory.mktemp(family)
    model.save_pretrained(d)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets)))
    with torch.no_grad():             # B nonzero: A's gradients are not zero
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    cfg = hf.config_from_hf(d)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=targets)
    decls = adapters.init(llama.init(cfg), lc)
    adapter_sd = {k.replace(".default", ""): v.detach().clone() for k, v in pm.state_dict().items() if "lora_" in k}
    full = adapters.joined(hf.load_hf_params(d, cfg), peft_dir.from_peft(adapter_sd, decls))
    return family, pm, cfg, lc, decls, full, targets


def test_loss_gradients_and_update_equal_peft(case):
    family, pm, cfg, lc, decls, full, targets = case
    batch = make_batch(cfg, batch=2, seq=12, seed=3)
    ours = train_adapters(cfg, lc, decls, full, [batch], fpp.Mesh(), fpp.Rules(), LR, WD)[0]
    logits = pm(input_ids=batch["tokens"]).logits
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    ref.backward()
    trainable = [p for p in pm.parameters() if p.requires_grad]
    ref_grads = {k.replace(".default", ""): p.grad.clone() for k, p in pm.named_parameters() if p.requires_grad}
    torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD).step()
    ref_new = {k.replace(".default", ""): p.detach() for k, p in pm.named_parameters() if p.requires_grad}
    torch.testing.assert_close(torch.tensor(float(ours[0][0])), ref.detach().reshape(()), rtol=1e-5, atol=1e-6)
    ours_grads, ours_new = peft_dir.to_peft(ours[1], cfg.model_type), peft_dir.to_peft(ours[2], cfg.model_type)
    assert ours_grads.keys() == ref_grads.keys() and len(ref_grads) == 2 * len(targets) * cfg.layers
    for k in ref_grads:
        assert ref_grads[k].abs().max() > 0, k
        torch.testing.assert_close(ours_grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {k}: {m}")
        torch.testing.assert_close(ours_new[k], ref_new[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"new {k}: {m}")


@pytest.mark.parametrize("case", ["apertus"], indirect=True)
def test_apertus_adapters_every_layout_equals_one_device(case):
    """(xIELU's scalars frozen beside the adapted up / down projections)"""
    _, _, cfg, lc, _, full, _ = case
    assert_adapter_layouts_equal_one_device(cfg, lc, full)
