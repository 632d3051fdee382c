"""``do_causal_lm_eval`` with ``eval_causal_lm_metrics: [perplexity]`` (data/causal_lm_eval.py,
app/evaluate.py): the ``eval_perplexity`` a run logs equals Axolotl's ``Perplexity`` metric computed
directly with transformers (the tiny Llama and its tokenizer loaded by transformers, the held-out
rows' completions re-tokenized, padded and scored in windows of ``eval_max_new_tokens`` every 512
tokens, exp of the windows' mean loss), before training and after it (the exported model); under
FSDP (2 simulated devices) it equals one device's (docs/finetune.md "Perplexity")."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from functional_pp import cli

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _rows(n: int = 24, seed: int = 0) -> list[dict]:
    """Alpaca rows, a few with completions longer than 512 tokens (a second perplexity window)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = rng.randint(4, 12) if i % 3 else rng.randint(300, 420)
        rows.append({"instruction": f"Count from {i}.", "input": "",
                     "output": " ".join(str(rng.randint(0, 99)) for _ in range(words))})
    return rows


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    root = tmp_path_factory.mktemp("ppl")
    rows = _rows()
    (root / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([r["instruction"] + r["output"] for r in rows],
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                                initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet())))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    model_dir = root / "tiny-llama"
    fast.save_pretrained(model_dir)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(model_dir)
    return root


def _config(inputs: Path, out: Path, **extra) -> Path:
    conf = {"base_model": str(inputs / "tiny-llama"), "datasets": [{"path": str(inputs / "alpaca.jsonl"),
                                                                    "type": "alpaca"}],
            "val_set_size": 0.25, "sequence_len": 32, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-2,
            "eval_steps": 2, "save_steps": 2, "do_causal_lm_eval": True, "eval_causal_lm_metrics": ["perplexity"],
            "eval_max_new_tokens": 16, "eval_sample_packing": False, "output_dir": str(out), **extra}
    path = out.parent / f"{out.name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(conf))
    return path


def _axolotl_perplexity(model, tokenizer, references: list[str], max_seq_len: int, stride: int = 512) -> float:
    """Axolotl's ``Perplexity.compute`` (axolotl/utils/callbacks/perplexity.py), with transformers."""
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token        # (Axolotl's fallback)
    input_ids = tokenizer(references, return_tensors="pt", padding=True, truncation=True)["input_ids"]
    length = input_ids.size(1)
    losses, prev_end = [], 0
    for begin in range(0, length, stride):
        end = min(begin + max_seq_len, length)
        trg_len = end - prev_end
        ids = input_ids[:, begin:end]
        labels = ids.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=labels).loss)
        prev_end = end
        if end == length:
            break
    assert len(losses) > 1, "the references should reach a second window"
    return torch.exp(torch.stack(losses).mean()).item()


def _references(path: Path) -> list[str]:
    """The held-out rows' completions, as Axolotl's callback decodes them (labels != -100)."""
    from functional_pp.app.inputs import load_data
    from functional_pp.config import TrainConfig
    from functional_pp.data.causal_lm_eval import references
    data = load_data(TrainConfig.from_yaml(path))
    refs = references(data.val, data.tokenizer)
    outputs = {r["output"] for r in _rows()}
    assert len(refs) == 6 and all(r in outputs for r in refs)           # each a held-out row's completion
    return refs


def _logged(out: Path) -> dict[int, float]:
    return {m["step"]: m["eval_perplexity"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "eval_perplexity" in m}


def test_eval_perplexity_equals_axolotls_metric_computed_with_transformers(inputs, tmp_path):
    path = _config(inputs, tmp_path / "one")
    assert cli.main(["train", str(path), "--simulate", "1"]) == 0
    logged = _logged(tmp_path / "one")
    assert sorted(logged) == [0, 2]
    refs = _references(path)
    tok = transformers.AutoTokenizer.from_pretrained(inputs / "tiny-llama")
    base = transformers.AutoModelForCausalLM.from_pretrained(inputs / "tiny-llama", dtype=torch.float32).eval()
    assert logged[0] == pytest.approx(_axolotl_perplexity(base, tok, refs, 16), rel=1e-5)
    assert cli.main(["export", str(tmp_path / "one"), str(tmp_path / "hf")]) == 0
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert logged[2] == pytest.approx(_axolotl_perplexity(trained, tok, refs, 16), rel=1e-5)
    assert logged[2] != pytest.approx(logged[0], rel=1e-3)
    # FSDP on two simulated devices: the same numbers
    two = _config(inputs, tmp_path / "two", dp_shard_size=2, micro_batch_size=1)      # (the same global batch)
    assert cli.main(["train", str(two), "--simulate", "2"]) == 0
    for step, value in _logged(tmp_path / "two").items():
        assert value == pytest.approx(logged[step], rel=1e-5), step


@pytest.mark.parametrize("extra,message", [
    ({"eval_causal_lm_metrics": None}, "eval_causal_lm_metrics: sacrebleu, comet, ter, chrf score text generated"),
    ({"eval_causal_lm_metrics": ["perplexity", "chrf"]}, "eval_causal_lm_metrics: chrf score text generated"),
    ({"val_set_size": 0}, "do_causal_lm_eval evaluates the held-out rows: set val_set_size > 0"),
    ({"eval_max_new_tokens": 64}, "eval_max_new_tokens=64: the perplexity window must be 2 to sequence_len"),
    ({"special_tokens": {"pad_token": "<unk>"}}, "special_tokens.pad_token with do_causal_lm_eval"),
])
def test_what_causal_lm_eval_cannot_do_is_refused_by_name(inputs, tmp_path, extra, message):
    from functional_pp.config import ConfigError, TrainConfig
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_yaml(_config(inputs, tmp_path / "bad", **extra)).validate(1)


@pytest.mark.multiprocess
def test_eval_perplexity_on_two_gloo_processes_equals_simulation(inputs, tmp_path):
    """FSDP over two processes (torchrun, gloo): each reads the held-out rows, builds the windows
    and evaluates its block; the logged perplexities equal the simulated run's."""
    import os
    import subprocess
    import sys
    real = _config(inputs, tmp_path / "real", dp_shard_size=2, micro_batch_size=1)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "functional_pp", "train", str(real)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sim = _config(inputs, tmp_path / "sim", dp_shard_size=2, micro_batch_size=1)
    assert cli.main(["train", str(sim), "--simulate", "2"]) == 0
    got, want = _logged(tmp_path / "real"), _logged(tmp_path / "sim")
    assert sorted(got) == sorted(want) == [0, 2]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
