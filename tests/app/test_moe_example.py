"""examples/configs/qwen3_moe_ep.yaml: a tiny Hugging Face Qwen3-MoE (made by transformers,
nothing downloaded) fine-tuned with FSDP 2 x expert parallelism 2 (``expert_parallel_size``,
Axolotl's name) on 4 simulated devices through the command line: the mesh has ``ep``, the
experts are split over it and dispatched with all-to-alls (here with a static capacity and the
router z-loss, set from the command line), the routing is in metrics.jsonl, the loss falls, and
the exported directory loads as Qwen3MoeForCausalLM with logits equal to the trained parameters'."""
import importlib.util
from pathlib import Path

import pytest
import torch
from harness import our_logits, tokens

from functional_pp import cli
from functional_pp.app.metrics import read_metrics
from functional_pp.checkpoint import hf

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "qwen3_moe_ep.yaml"


def _make_model(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_moe", ROOT / "examples" / "make_tiny_qwen3_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_model(out)


def test_qwen3_moe_ep_example_trains_and_exports(tmp_path, capsys):
    base = _make_model(tmp_path / "tiny-qwen3-moe")
    out = tmp_path / "run"
    assert cli.main(["train", str(CONFIG), "--set", f"base_model={base}", "--simulate", "4",
                     "--set", "capacity_factor=1.5", "--set", "router_z_loss_coef=0.001",
                     "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dp_shard=2 x cp=1 x tp=1 x ep=2 = 4 devices" in printed and "experts=ep" in printed
    assert "model_type=qwen3_moe" in printed
    assert any(line.split()[:2] == ["ep", "all_to_all"] for line in printed.splitlines())
    losses = [m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5
    rows = [m for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
    assert all(len(m["moe_tokens_per_expert"]) == 4 and m["moe_load_balance"] >= 1 and m["moe_z_loss"] > 0
               and m["moe_dropped"] >= 0 for m in rows)
    exported = hf.export_checkpoint_to_hf(out / "checkpoints", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32,
                                                              attn_implementation="eager",
                                                              experts_implementation="eager")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    cfg, params = hf.load_hf_llama(exported)
    assert (cfg.experts, cfg.router_aux_loss_coef) == (4, 0.01)
    toks = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=toks).logits, our_logits(params, cfg, toks), atol=1e-5, rtol=1e-5)
