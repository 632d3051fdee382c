"""models/quantize.py on a Hugging Face checkpoint: a tiny Llama built by transformers, loaded
quantized by transformers + bitsandbytes (``load_in_4bit``, NF4, on CPU) and by us
(hf.load_hf_llama, then quantize_linear_weights): the logits agree."""
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

# head_dim 64 and hidden 128: whole NF4 blocks of 64 in every linear weight
KW = dict(vocab_size=256, hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
          intermediate_size=256, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**KW)).float().eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    with torch.no_grad():
        full = model(input_ids=tokens()).logits
    return path, full


def _bnb_logits(path, double_quant):
    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_use_double_quant=double_quant,
                                          bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, dtype=torch.float32,
                                                              device_map="cpu").eval()
    model.config._attn_implementation = "eager"
    for module in model.modules():       # on CPUs with AVX512-BF16, bitsandbytes' inference path
        if hasattr(module, "support_avx512bf16_for_cpu"):     # repacks the codes and multiplies in bf16
            module.support_avx512bf16_for_cpu = False         # (4e-3 off): keep the fp32 compute asked for
    with torch.no_grad():
        return model(input_ids=tokens()).logits


def _our_logits(path, double_quant):
    cfg, params = hf.load_hf_llama(path)
    qp, qd = quantize_linear_weights(params, llama.init(cfg), "nf4", double_quant=double_quant)
    with torch.no_grad():
        return llama.forward(sharding.named_tree(qp, qd), fpp.wrap(tokens(), "batch seq"), cfg).value()


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_logits_equal_transformers_with_bitsandbytes(checkpoint, double_quant):
    path, full = checkpoint
    want, got = _bnb_logits(path, double_quant), _our_logits(path, double_quant)
    assert (want - full).abs().max() > 0.02          # quantization moved the logits
    # single quantization: the same codes and scales (fp32 rounding of the matmuls apart); double: bitsandbytes'
    # native CPU kernel quantizes the scales, and it does not round to the nearest code (docs/quantization.md)
    torch.testing.assert_close(got, want, atol=1e-5 if not double_quant else 1e-2, rtol=0)
