"""Create the inputs of ``examples/configs/finetune.yaml`` without downloading anything: an
alpaca-style jsonl of arithmetic instructions, a small BPE tokenizer trained on it (the
``tokenizers`` package) and a small random Llama saved by ``transformers`` (sharded
safetensors). ``python examples/make_tiny_hf_llama.py [OUT_DIR]`` (default examples/finetune)."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def make_alpaca(path: Path, n: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        if rng.random() < 0.5:
            rows.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": f"{a + b}"})
        else:
            rows.append({"instruction": f"What is {a} plus {b}?", "input": "", "output": f"It is {a + b}."})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_tokenizer(out: Path, texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()))
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, vocab: int, bos: int, eos: int, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                      rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=bos, eos_token_id=eos,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(out, safe_serialization=True, max_shard_size="200KB")
    return model


def main(out: str | Path = "examples/finetune") -> Path:
    from functional_pp.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = make_alpaca(out / "alpaca.jsonl")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    texts = [(ALPACA_PROMPT if r["input"] else ALPACA_PROMPT_NO_INPUT).format(**r) + r["output"] for r in rows]
    model_dir = out / "tiny-llama"
    fast = make_tokenizer(model_dir, texts)
    make_model(model_dir, len(fast), fast.bos_token_id, fast.eos_token_id)
    print(f"wrote {data} and {model_dir}")
    return out


if __name__ == "__main__":
    main(*sys.argv[1:])
