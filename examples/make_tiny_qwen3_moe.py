"""Create the model of ``examples/configs/qwen3_moe_ep.yaml`` without downloading anything: a
small random Qwen3-MoE (4 experts, top-2, byte vocabulary) saved by ``transformers``.
``python examples/make_tiny_qwen3_moe.py [OUT_DIR]`` (default examples/finetune/tiny-qwen3-moe)."""
from __future__ import annotations

import sys
from pathlib import Path


def make_model(out: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    torch.manual_seed(seed)
    conf = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01, max_position_embeddings=256,
        tie_word_embeddings=False)
    transformers.Qwen3MoeForCausalLM(conf).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(make_model(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/finetune/tiny-qwen3-moe")))
