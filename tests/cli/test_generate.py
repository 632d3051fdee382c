"""``functional-pp generate`` (functional_pp/cli/generate.py, app/generate_run.py): on a tiny
Hugging Face Llama directory it prints exactly what transformers' greedy ``generate`` decodes for
the same left-padded prompts (plain and ``--chat`` through ``apply_chat_template``); on a run
directory after ``functional-pp train`` it equals transformers on the run's export; a FSDP x TP
layout (simulated, and 2 gloo processes under torchrun) prints what one device prints; bad input
exits with status 2 and a message naming the problem."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from functional_pp import cli

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PROMPTS = ["What is 3 plus 4?", "It", "Add the two numbers."]
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def _example():
    spec = importlib.util.spec_from_file_location("make_tiny_hf_llama", EXAMPLES / "make_tiny_hf_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama (weights large enough that tokens are far from ties) with a BPE
    tokenizer that has a chat template, and the alpaca data it can fine-tune on."""
    root = tmp_path_factory.mktemp("gen")
    ex = _example()
    data = ex.make_alpaca(root / "alpaca.jsonl")
    out = root / "hf"
    fast = ex.make_tokenizer(out, [f"What is {a} plus {b}? It is {a + b}." for a in range(20) for b in range(5)])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(out)
    return out, data


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = cli.main(["generate", *map(str, args)])
    return status, out.getvalue(), err.getvalue()


def _transformers(model_dir, prompts, max_new_tokens=8, chat=False) -> list[str]:
    """transformers' greedy completions of the left-padded prompts, decoded without special tokens."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tok.pad_token = tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)
    assert enc["attention_mask"].min() == 0                       # prompts of different lengths
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return [tok.decode(row, skip_special_tokens=True) for row in out[:, enc["input_ids"].size(1):]]


def test_prints_what_transformers_greedy_generate_decodes(hf_dir):
    model_dir, _ = hf_dir
    status, out, err = _cli(model_dir, *(a for p in PROMPTS for a in ("--prompt", p)), "--max-new-tokens", 8)
    assert status == 0, err
    want = _transformers(model_dir, PROMPTS)
    assert out == "".join(w + "\n" for w in want)
    assert len(set(want)) == len(want) and all(want)


def test_chat_renders_the_template_with_its_generation_prompt(hf_dir):
    model_dir, _ = hf_dir
    status, out, err = _cli(model_dir, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--chat", "--json",
                            "--max-new-tokens", 6)
    assert status == 0, err
    got = json.loads(out)["completions"]
    assert [c["completion"] for c in got] == _transformers(model_dir, PROMPTS[:2], 6, chat=True)
    assert [c["prompt"] for c in got] == PROMPTS[:2]
    assert all(c["finish_reason"] in ("stop", "length") and c["completion_ids"] for c in got)


def test_stops_at_every_eos_of_the_generation_config(hf_dir, tmp_path):
    """A list of EOS ids (Llama 3's generation_config.json): the completion ends at the first of them."""
    import shutil
    model_dir = tmp_path / "hf"
    shutil.copytree(hf_dir[0], model_dir)
    free = json.loads(_cli(model_dir, "--prompt", PROMPTS[0], "--max-new-tokens", 8, "--json")[1])["completions"][0]
    stop = free["completion_ids"][3]
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], stop]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    got = json.loads(_cli(model_dir, "--prompt", PROMPTS[0], "--max-new-tokens", 8, "--json")[1])["completions"][0]
    end = free["completion_ids"].index(stop) + 1
    assert got["completion_ids"] == free["completion_ids"][:end] and got["finish_reason"] == "stop"
    assert free["finish_reason"] == "length"


def test_simulated_fsdp_tp_prints_what_one_device_prints(hf_dir):
    model_dir, _ = hf_dir
    args = [model_dir, *(a for p in PROMPTS for a in ("--prompt", p)), "--max-new-tokens", 6, "--temperature", 0.9,
            "--top-k", 20, "--seed", 3, "--json"]
    one, four = _cli(*args), _cli(*args, "--simulate", 4, "--set", "tp_size=2")
    assert one[0] == four[0] == 0, one[2] + four[2]
    assert json.loads(one[1]) == json.loads(four[1])
    greedy = _cli(*args[:-7], "--json")
    assert json.loads(greedy[1]) != json.loads(one[1])             # sampled: not the greedy tokens


def test_compiled_decode_step_prints_what_eager_prints(hf_dir):
    """``--compile``: the one-token forward compiled over a static cache; the same completions."""
    model_dir, _ = hf_dir
    args = [model_dir, *(a for p in PROMPTS for a in ("--prompt", p)), "--max-new-tokens", 6, "--json"]
    eager, compiled = _cli(*args), _cli(*args, "--compile", "aot_eager")
    assert eager[0] == compiled[0] == 0, eager[2] + compiled[2]
    assert json.loads(compiled[1]) == json.loads(eager[1])
    assert json.loads(eager[1])["completions"][0]["completion"] == _transformers(model_dir, PROMPTS, 6)[0]


def test_memory_prints_the_dry_run_of_the_generation(hf_dir):
    """``--memory``: the per-device dry run (plan.estimate_generation) instead of generating; its
    cache is ``cache_bytes`` of the batch's prompt + new tokens, split by FSDP x TP."""
    from functional_pp.app.report import human_bytes
    from functional_pp.checkpoint import hf
    from functional_pp.models.kv_cache import cache_bytes
    model_dir, _ = hf_dir
    cfg, _ = hf.load_hf_llama(model_dir)
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    status, out, err = _cli(model_dir, *prompts, "--max-new-tokens", 6, "--memory")
    assert status == 0, err
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    longest = max(len(tok(p)["input_ids"]) for p in PROMPTS)
    assert f"key / value cache  {human_bytes(cache_bytes(cfg, len(PROMPTS), longest + 6))}" in out
    assert "peak" in out and "one device" in out
    status, four, err = _cli(model_dir, *prompts, "--max-new-tokens", 6, "--memory", "--simulate", 4, "--set",
                             "tp_size=2")
    assert status == 0, err
    rows = 2 if len(PROMPTS) % 2 == 0 else 1
    want = cache_bytes(cfg, len(PROMPTS), longest + 6, batch_split=rows, kv_heads_split=2)
    assert f"key / value cache  {human_bytes(want)}" in four and "dp_shard=2 x tp=2" in four


def test_run_directory_equals_transformers_on_its_export(hf_dir, tmp_path):
    model_dir, data = hf_dir
    run = tmp_path / "run"
    assert cli.main(["train", str(EXAMPLES / "configs" / "finetune.yaml"), "--set", f"base_model={model_dir}",
                     "--set", f"datasets=[{{path: {data}, type: alpaca}}]", "--max-steps", "2",
                     "--output", str(run)]) == 0
    assert cli.main(["export", str(run), str(tmp_path / "hf")]) == 0
    args = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", 12]
    status, out, err = _cli(run, *args)
    assert status == 0, err
    want = _transformers(tmp_path / "hf", PROMPTS[:2], 12)
    assert out == "".join(w + "\n" for w in want)
    assert out != _cli(model_dir, *args)[1]                                 # the trained weights, not the base
    sim = _cli(run, *args, "--simulate", 4)                                 # the run's layout: FSDP 2 x TP 2
    assert sim[0] == 0 and sim[1] == out, sim[2]
    step = _cli(run / "checkpoints" / "step-000002", *args)                  # a checkpoint directory
    assert step[0] == 0 and step[1] == out, step[2]
    assert _cli(run, *args, "--step", 1)[0] == 2                            # not saved: exit 2


def test_lora_run_generates_with_its_adapters_merged(hf_dir, tmp_path):
    model_dir, data = hf_dir
    run = tmp_path / "run"
    assert cli.main(["train", str(EXAMPLES / "configs" / "finetune.yaml"), "--set", f"base_model={model_dir}",
                     "--set", f"datasets=[{{path: {data}, type: alpaca}}]", "--set", "adapter=lora",
                     "--set", "lora_r=4", "--set", "lora_alpha=8", "--set", "lora_target_linear=true",
                     "--set", "learning_rate=0.05", "--set", "warmup_ratio=0", "--max-steps", "2",
                     "--output", str(run)]) == 0
    assert cli.main(["export", "--merge-adapter", str(run), str(tmp_path / "merged")]) == 0
    args = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--max-new-tokens", 10]
    status, out, err = _cli(run, *args)
    assert status == 0, err
    assert out == "".join(w + "\n" for w in _transformers(tmp_path / "merged", [PROMPTS[0], PROMPTS[2]], 10))
    assert out != _cli(model_dir, *args)[1]                                 # the adapters change the tokens


def test_byte_level_run_generates_bytes(tmp_path):
    """A run without a tokenizer (UTF-8 bytes, EOS byte 0): its completions are transformers' greedy
    tokens on the run's export, decoded as bytes."""
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "bytes.yaml").write_text(f"""
model: {{preset: tiny, hidden: 32, mlp: 64, layers: 2}}
data: {{path: {tmp_path / 'corpus.txt'}}}
sequence_len: 16
micro_batch_size: 4
global_batch_size: 4
learning_rate: 0.01
max_steps: 3
""")
    run = tmp_path / "run"
    assert cli.main(["train", str(tmp_path / "bytes.yaml"), "--output", str(run)]) == 0
    assert cli.main(["export", str(run), str(tmp_path / "hf")]) == 0
    status, out, err = _cli(run, "--prompt", "the quick", "--prompt", "a", "--max-new-tokens", 8, "--json")
    assert status == 0, err
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.tensor([list(b"the quick"), [0] * 8 + list(b"a")])
    mask = (torch.arange(9)[None, :] >= torch.tensor([[0], [8]])).long()
    want = model.generate(tokens, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=0,
                          pad_token_id=0)[:, 9:]
    got = json.loads(out)["completions"]
    for row, c in zip(want.tolist(), got):
        row = row[:row.index(0) + 1] if 0 in row else row
        assert c["completion_ids"] == row
        assert c["completion"] == bytes(row[:-1] if row[-1:] == [0] else row).decode("utf-8", errors="replace")
    assert sum(len(c["completion_ids"]) for c in got) > 8


@pytest.mark.parametrize("args,message", [
    (["--prompt", ""], "--prompt 1 is empty"),
    (["--prompt", "What is 3 plus 4?", "--max-new-tokens", "60"], r"past the model's context of 64"),
    (["--prompt", "x", "--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--prompt", "x", "--top-p", "nan"], r"--top-p must be in \(0, 1\], got nan"),
    (["--prompt", "x", "--temperature", "nan"], r"--temperature must be >= 0 \(0: greedy\), got nan"),
    (["--prompt", "x", "--set", "cp_size=2"], "generate takes the layout keys"),
    (["--prompt", "x", "--compile", "inductr"], "--compile: compile must be True, False or a torch.compile backend"),
    (["--prompt", "x", "--max-new-tokens", "4", "--simulate", "3", "--set", "tp_size=2"],
     "does not divide the 3 devices"),
])
def test_bad_input_exits_2_naming_the_problem(hf_dir, args, message):
    import re
    status, out, err = _cli(hf_dir[0], *args)
    assert status == 2 and not out and re.search(message, err), err


def test_sources_without_a_model_are_refused(tmp_path):
    status, _, err = _cli(tmp_path / "nowhere", "--prompt", "x")
    assert status == 2 and "no such directory" in err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    status, _, err = _cli(tmp_path / "run", "--prompt", "x")
    assert status == 2 and "train first" in err, err
    (tmp_path / "empty").mkdir()
    status, _, err = _cli(tmp_path / "empty", "--prompt", "x")
    assert status == 2 and "holds no checkpoint" in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_gloo_processes_print_what_one_device_prints(hf_dir):
    model_dir, _ = hf_dir
    args = [str(model_dir), *(a for p in PROMPTS for a in ("--prompt", p)), "--max-new-tokens", "6", "--json"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "functional_pp", "generate", *args, "--set", "tp_size=2"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status, one, err = _cli(*args)
    assert status == 0, err
    assert json.loads(proc.stdout) == json.loads(one)
