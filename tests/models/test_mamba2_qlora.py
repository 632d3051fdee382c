"""QLoRA's NF4 base of a Mamba2 hybrid (Nemotron-H): every linear bitsandbytes quantizes (the
Mamba2 in_proj, whose rows are our z / x / B / C / dt projections, and out_proj; attention's and
the MLP's projections) quantized as transformers + bitsandbytes quantize them gives the same logits."""
from __future__ import annotations

import pytest
import torch
from harness import tokens

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.models import llama
from functional_pp.models.quantize import quantize_linear_weights
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

# sizes that hold whole blocks of 64 along every quantized weight's input (hidden, the heads' width)
CONFIG = dict(vocab_size=256, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
              layers_block_type=["linear_attention", "full_attention", "mlp"], intermediate_size=128,
              mamba_num_heads=2, mamba_head_dim=64, n_groups=1, ssm_state_size=64, chunk_size=4,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, initializer_range=0.1)


def test_nf4_base_equals_transformers_with_bitsandbytes(tmp_path):
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**CONFIG)).float().eval()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        full = model(input_ids=tokens()).logits
    bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                                          bnb_4bit_compute_dtype=torch.float32)
    q = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb, dtype=torch.float32,
                                                          device_map="cpu", attn_implementation="eager").eval()
    for module in q.modules():           # (bitsandbytes' bf16 CPU path off: the fp32 compute asked for)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        want = q(input_ids=tokens()).logits
    cfg, params = hf.load_hf_llama(tmp_path)
    qp, qd = quantize_linear_weights(params, llama.init(cfg), "nf4", double_quant=False)
    mixer = qp["layers"][0]["mamba"]
    assert {k for k, v in mixer.items() if type(v).__name__ == "QuantizedWeight"} == {
        "z_proj", "x_proj", "b_proj", "c_proj", "dt_proj", "out_proj"}
    with torch.no_grad():
        got = llama.forward(sharding.named_tree(qp, qd), fpp.wrap(tokens(), "batch seq"), cfg).value()
    assert (want - full).abs().max() > 0.01
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
