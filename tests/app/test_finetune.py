"""The Axolotl-style fine-tune of examples/configs/finetune.yaml on 4 simulated devices: a
small HF Llama made by transformers (nothing downloaded), alpaca data; the first-step loss
equals transformers' loss on the same batch, the held-out loss falls, and the exported
directory loads in transformers with logits equal to the trained parameters'."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.app.inputs import load_data
from functional_pp.app.metrics import read_metrics
from functional_pp.config import TrainConfig
from functional_pp.core import tree
from functional_pp.data import DataLoader
from functional_pp.models import llama
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "finetune.yaml"


def _make_inputs(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny", ROOT / "examples" / "make_tiny_hf_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(out)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return _make_inputs(tmp_path_factory.mktemp("ft"))


def _overrides(inputs: Path, out: Path) -> list[str]:
    return ["--set", f"base_model={inputs / 'tiny-llama'}",
            "--set", f"datasets=[{{path: {inputs / 'alpaca.jsonl'}, type: alpaca}}]",
            "--output", str(out)]


def _hf_nll(model, tokens: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor) -> tuple[float, int]:
    """transformers' summed NLL over the valid labels, each packed document run alone."""
    total, count = 0.0, 0
    for row in range(tokens.shape[0]):
        for s in segments[row].unique():
            idx = (segments[row] == s).nonzero().flatten()
            lab = labels[row, idx]
            if (lab == -100).all():
                continue
            with torch.no_grad():
                logits = model(input_ids=tokens[row, idx][None]).logits[0]
            total += float(F.cross_entropy(logits, lab, ignore_index=-100, reduction="sum"))
            count += int((lab != -100).sum())
    return total, count


@pytest.mark.slow
def test_finetune_example_matches_transformers_and_exports(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", str(CONFIG), *_overrides(inputs, out)]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "4 simulated devices on the CPU" in printed and "tiny-llama" in printed
    lines = read_metrics(out / "metrics.jsonl")
    train = [m for m in lines if "loss" in m]
    evals = [m["eval_loss"] for m in lines if "eval_loss" in m]
    assert [m["step"] for m in train] == list(range(1, 13))
    assert len(evals) == 4 and evals[-1] < evals[0] - 0.5           # held-out loss falls
    assert "eval " in printed and "gnorm" in printed and "elapsed" in printed

    # first-step loss == transformers' loss of the base model on the same (packed) batch
    cfg = TrainConfig.from_yaml(CONFIG, _overrides(inputs, out)[1:4:2])
    data = load_data(cfg)
    batch = DataLoader(data.train, global_batch_size=4, seq_len=cfg.sequence_len,
                       seed=cfg.seed).global_batch(0)
    assert (batch["labels"] == -100).any() and batch["segments"].max() > 0   # prompts masked, packed
    base = transformers.LlamaForCausalLM.from_pretrained(inputs / "tiny-llama").float().eval()
    nll, n = _hf_nll(base, batch["tokens"], batch["labels"], batch["segments"])
    assert train[0]["loss"] == pytest.approx(nll / n, rel=1e-5)

    # export: loads in transformers, logits equal the trained parameters'
    hf_dir = tmp_path / "hf"
    assert cli.main(["export", str(out), str(hf_dir)]) == 0
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (hf_dir / name).is_file(), name
    exported = transformers.LlamaForCausalLM.from_pretrained(hf_dir).float().eval()
    assert exported.config.eos_token_id == base.config.eos_token_id
    model_cfg = llama.Config.from_dict(ck.load_checkpoint(out / "checkpoints", keys=["step"]).metadata["model_config"])
    params = ck.load_checkpoint(out / "checkpoints", keys=["params"]).tree["params"]
    toks = batch["tokens"][:2, :32]
    with torch.no_grad():
        ours = llama.forward(sharding.named_tree(params, llama.init(model_cfg)),
                             fpp.wrap(toks, "batch seq"), model_cfg).value()
        theirs = exported(input_ids=toks).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(base(input_ids=toks).logits, theirs, atol=1e-2)     # it trained
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tok.eos_token == "</s>"
    sharded = tmp_path / "hf-sharded"                 # shards + index above --max-shard-size
    assert cli.main(["export", str(out / "checkpoints"), str(sharded), "--max-shard-size", "200KB"]) == 0
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("model-*.safetensors"))) > 1
    again = transformers.LlamaForCausalLM.from_pretrained(sharded).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=toks).logits, theirs)


def test_validate_prints_the_plan_and_trains_nothing(inputs, tmp_path, capsys):
    out = tmp_path / "never"
    assert cli.main(["validate", str(CONFIG), *_overrides(inputs, out)]) == 0
    text = capsys.readouterr().out
    assert "dp_shard=2 x cp=1 x tp=2 = 4 devices" in text and "held out" in text
    assert "config ok" in text and not out.exists()
    assert cli.main(["validate", str(CONFIG), *_overrides(inputs, out), "--set", "tp_size=3"]) == 2
    err = capsys.readouterr().err
    assert "'vocab' has size 320" in err and "base_model" in err and "tp': 3" in err
    assert cli.main(["validate", str(CONFIG), *_overrides(inputs, out), "--set", "micro_batch_size=64"]) == 2
    assert "fewer than global_batch_size=128" in capsys.readouterr().err


def test_export_of_a_cli_checkpoint_needs_no_config(inputs, tmp_path):
    """export_checkpoint_to_hf reads the model from the checkpoint the CLI wrote."""
    out = tmp_path / "run"
    assert cli.main(["train", str(CONFIG), *_overrides(inputs, out), "--max-steps", "1",
                     "--set", "val_set_size=0", "--set", "tp_size=1", "--set", "dp_shard_size=1"]) == 0
    from functional_pp.checkpoint.hf import export_checkpoint_to_hf
    hf_dir = export_checkpoint_to_hf(out / "checkpoints", tmp_path / "hf")
    base = json.loads((inputs / "tiny-llama" / "config.json").read_text())
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["hidden_size"]) == (base["vocab_size"], base["hidden_size"])
    transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    preset = tmp_path / "preset"                      # a run from a preset exports too
    assert cli.main(["train", str(ROOT / "examples" / "configs" / "single.yaml"), "--max-steps", "1",
                     "--output", str(preset), "--set", "data.max_bytes=20000", "--set", "warmup_steps=0"]) == 0
    assert export_checkpoint_to_hf(preset / "checkpoints", tmp_path / "hf2").is_dir()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_finetune_under_torchrun_equals_simulation(inputs, tmp_path):
    """Two gloo processes (TP 2): base model slices, packed documents, held-out loss."""
    import os
    import subprocess
    import sys
    short = ["--max-steps", "3", "--set", "dp_shard_size=1", "--set", "eval_steps=3",
             "--set", "save_steps=0"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "functional_pp", "train", str(CONFIG),
                           *_overrides(inputs, tmp_path / "torchrun"), *short],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert cli.main(["train", str(CONFIG), *_overrides(inputs, tmp_path / "sim"), *short]) == 0
    real, sim = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("torchrun", "sim"))
    assert [m["step"] for m in real] == [m["step"] for m in sim] == [0, 1, 2, 3]
    for a, b in zip(real, sim):
        for key in ("loss", "eval_loss"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key)
