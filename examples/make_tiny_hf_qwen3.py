"""Create the inputs of ``examples/configs/lora.yaml`` and ``qlora.yaml`` without downloading anything: the
alpaca-style arithmetic data and BPE tokenizer of ``make_tiny_hf_llama.py`` and a small random
Qwen3 (per-head q/k norms, explicit head_dim) saved by ``transformers``.
``python examples/make_tiny_hf_qwen3.py [OUT_DIR]`` (default examples/finetune)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path


def _llama_example():
    spec = importlib.util.spec_from_file_location("make_tiny_hf_llama", Path(__file__).with_name("make_tiny_hf_llama.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_model(out: Path, vocab: int, bos: int, eos: int, seed: int = 0, head_dim: int = 16):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=head_dim, intermediate_size=128, max_position_embeddings=256,
                      rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=bos, eos_token_id=eos,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).float()
    model.save_pretrained(out, safe_serialization=True)
    return model


def main(out: str | Path = "examples/finetune") -> Path:
    from functional_pp.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
    llama_example = _llama_example()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = llama_example.make_alpaca(out / "alpaca.jsonl")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    texts = [(ALPACA_PROMPT if r["input"] else ALPACA_PROMPT_NO_INPUT).format(**r) + r["output"] for r in rows]
    model_dir = out / "tiny-qwen3"
    fast = llama_example.make_tokenizer(model_dir, texts)
    make_model(model_dir, len(fast), fast.bos_token_id, fast.eos_token_id)
    # qlora.yaml's: head_dim 64, so o_proj's input features hold whole NF4 blocks of 64 (the blocked form;
    # head_dim 16 puts o_proj in bitsandbytes' flat form, docs/quantization.md "Any shape")
    qlora_dir = out / "tiny-qwen3-hd64"
    fast.save_pretrained(qlora_dir)
    make_model(qlora_dir, len(fast), fast.bos_token_id, fast.eos_token_id, head_dim=64)
    print(f"wrote {data}, {model_dir} and {qlora_dir}")
    return out


if __name__ == "__main__":
    main(*sys.argv[1:])
