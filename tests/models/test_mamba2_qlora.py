"""QLoRA's NF4 base of a Mamba2 hybrid (Nemotron-H): every linear bitsandbytes quantizes (the
Mamba2 in_proj, whose rows are our z / x / B / C / dt projections, and out_proj; attention's and
the MLP's projections) quantized as transformers + bitsandbytes quantize them gives the same logits."""
from __future__ import annotations

import pytest
import torch
from harness import assert_nf4_base_equals_bitsandbytes

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
    qp = assert_nf4_base_equals_bitsandbytes(model, tmp_path, attn_implementation="eager")
    mixer = qp["layers"][0]["mamba"]
    assert {k for k, v in mixer.items() if type(v).__name__ == "QuantizedWeight"} == {
        "z_proj", "x_proj", "b_proj", "c_proj", "dt_proj", "out_proj"}
