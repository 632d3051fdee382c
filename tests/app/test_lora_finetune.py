"""The LoRA fine-tune of examples/configs/lora.yaml (a tiny Qwen3 made by
examples/make_tiny_hf_qwen3.py, nothing downloaded) on 4 simulated devices (FSDP 2 x TP 2):
the base stays bitwise the model's, the adapters train, and both exports round-trip: the PEFT
adapter directory through ``peft.PeftModel.from_pretrained`` and the merged model through
``transformers``, each with logits equal to ours (docs/adapters.md)."""
import json
from pathlib import Path

import pytest
import torch
from harness import run_lora_config, tiny_qwen3_finetune

import functional_pp as fpp
from functional_pp import adapters
from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "lora.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return (*tiny_qwen3_finetune(root, "lora.yaml", "tiny-qwen3", "max_steps=4", "save_steps=2"), root)


def _train_args(run) -> list[str]:
    base_dir, out, root = run
    return ["train", str(CONFIG), "--set", f"base_model={base_dir}",
            "--set", f"datasets=[{{path: {base_dir.parent / 'alpaca.jsonl'}, type: alpaca}}]",
            "--set", "max_steps=4", "--set", "save_steps=2"]


def _ours(run):
    base_dir, out, _ = run
    cfg = hf.config_from_hf(base_dir)
    lc = run_lora_config(out)
    params = ck.load_checkpoint(out / "checkpoints", keys=["params"]).tree["params"]
    return cfg, lc, params


def _our_logits(cfg, lc, params, toks):
    decls = adapters.init(llama.init(cfg), lc)
    named = sharding.named_tree(params, decls)
    with torch.no_grad():
        return adapters.adapt(llama.forward, lc)(named, fpp.wrap(toks, "batch seq"), cfg).value()


def test_base_frozen_adapters_trained(run):
    cfg, lc, params = _ours(run)
    base = hf.load_hf_params(run[0], cfg)
    frozen, lora = adapters.split(params)
    for p, x in tree.leaves_with_paths(frozen):
        assert torch.equal(x, dict(tree.leaves_with_paths(base))[p]), p
    assert all(ab["lora_B"].abs().max() > 0 for ab in lora.values())
    assert len(lora) == 7 * cfg.layers            # lora_target_linear: every linear weight
    losses = [json.loads(line)["loss"] for line in (run[1] / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0]


def test_peft_adapter_and_merged_exports_load_with_equal_logits(run):
    base_dir, out, root = run
    cfg, lc, params = _ours(run)
    toks = torch.randint(0, cfg.vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = _our_logits(cfg, lc, params, toks)
    assert cli.main(["export", str(out), str(root / "adapter")]) == 0
    conf = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert (conf["peft_type"], conf["r"], conf["lora_alpha"]) == ("LORA", 8, 16)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
    with torch.no_grad():
        theirs = model(input_ids=toks).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert cli.main(["export", "--merge-adapter", str(out), str(root / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", torch_dtype=torch.float32).eval()
    assert type(merged).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=toks).logits, ours, rtol=1e-5, atol=1e-5)
    # the adapter directory starts a new run (lora_model_dir): the same adapters, read back
    from functional_pp.app.inputs import adapter_params
    from functional_pp.config import TrainConfig
    decls = adapters.init(llama.init(cfg), lc)
    start = TrainConfig.from_dict({"adapter": "lora", "lora_target_linear": True, "lora_r": 8, "lora_alpha": 16,
                                   "base_model": str(base_dir), "lora_model_dir": str(root / "adapter")})
    mesh, rules = fpp.Mesh(), fpp.Rules()
    again = fpp.launch(lambda: adapter_params(start, decls, mesh, rules), mesh)[0]
    for p, ab in adapters.split(params)[1].items():
        for k in ab:
            torch.testing.assert_close(again[p][k].data, ab[k], rtol=0, atol=0)


def test_resumed_lora_run_equals_the_uninterrupted_one(run):
    """The optimizer state of the adapters only is saved and restored: resuming from step 2
    gives steps 3 and 4 exactly."""
    import shutil
    _, out, root = run
    again = root / "resumed"
    shutil.copytree(out, again)
    shutil.rmtree(again / "checkpoints" / "step-000004")
    (again / "checkpoints" / "latest").write_text("step-000002")
    assert cli.main([*_train_args(run), "--output", str(again), "--resume"]) == 0

    def losses(d):
        return {m["step"]: m["loss"] for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                if "loss" in m}
    assert losses(again) == losses(out)
