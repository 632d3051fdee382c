"""Axolotl's ``nvfp4_merge_aware`` through the CLI: a tiny Qwen3 (examples/make_tiny_hf_qwen3.py)
written as a ModelOpt NVFP4 checkpoint by torchao, 2 steps of merge-aware LoRA on FSDP x TP (4
simulated devices), then ``export --merge-adapter``: an NVFP4 checkpoint in ModelOpt's layout whose
adapted weights, read back, are the trained ``Q(W + scale A B)`` bit for bit, its other weights
base_model's, and whose logits equal the trained model's merge-aware forward; the per-tensor scales
are base_model's stored ``weight_scale_2`` (which differ from the dequantized weights' own), as Axolotl's."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import run_lora_config
from safetensors.torch import load_file, save_file

import functional_pp as fpp
from functional_pp import adapters
from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding

nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
pytest.importorskip("tokenizers")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _modelopt(src: Path, out: Path) -> Path:
    """``src`` (an HF directory) with every decoder linear in ModelOpt's NVFP4 (torchao's quantizer)."""
    shutil.copytree(src, out)
    sd = load_file(out / "model.safetensors")
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        w = sd[k].float()
        t = nvfp4.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=nvfp4.per_tensor_amax_to_scale(w.abs().max()))
        sd.update({k: t.qdata.view(torch.uint8).contiguous(), f"{k}_scale": t.scale.contiguous(),
                   f"{k}_scale_2": t.per_tensor_scale.reshape(()).float(),
                   k.removesuffix(".weight") + ".input_scale": torch.tensor(0.01)})
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((out / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    (out / "config.json").write_text(json.dumps(conf))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4_merge_aware")
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3", EXAMPLES / "make_tiny_hf_qwen3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    inputs = mod.main(root / "inputs")
    base = _modelopt(inputs / "tiny-qwen3", root / "tiny-qwen3-nvfp4")
    out = root / "run"
    sets = [f"base_model={base}", f"datasets=[{{path: {inputs / 'alpaca.jsonl'}, type: alpaca}}]",
            "nvfp4_merge_aware=true", "lora_target_linear=false", "lora_target_modules=[q_proj, o_proj, down_proj]",
            "max_steps=2", "save_steps=2", "eval_steps=2", "bf16=false"]
    args = ["train", str(EXAMPLES / "configs" / "lora.yaml"), *(a for s in sets for a in ("--set", s)),
            "--output", str(out)]
    assert cli.main(args) == 0
    merged = root / "merged"
    assert cli.main(["export", "--merge-adapter", str(out), str(merged)]) == 0
    return base, out, merged


def test_the_merged_nvfp4_export_is_the_trained_model(run):
    base, out, merged = run
    cfg, lc = hf.config_from_hf(base), run_lora_config(out)
    assert lc.nvfp4_merge_aware
    decls = adapters.init(llama.init(cfg), lc)
    params = ck.load_checkpoint(out / "checkpoints", {"params": decls}, keys=["params"]).tree["params"]
    assert all(ab["lora_B"].abs().max() > 0 for ab in adapters.split(params)[1].values())
    files, source = load_file(merged / "model.safetensors"), load_file(base / "model.safetensors")
    assert set(files) == set(source)
    assert json.loads((merged / "config.json").read_text())["quantization_config"]["quant_algo"] == "NVFP4"
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert files[q].dtype == torch.uint8 and not torch.equal(files[q], source[q])
    assert torch.equal(files[k], source[k]) and torch.equal(files[k + "_scale"], source[k + "_scale"])
    assert torch.equal(files[q + "_scale_2"], source[q + "_scale_2"])      # (the stored scale trained with)
    stored = hf.nvfp4_stored_scales(base, list(adapters.split(params)[1]))
    _, back = hf.load_hf_llama(merged)
    trained = dict(tree.leaves_with_paths(adapters.merge(params, lc, stored)))
    for p, w in tree.leaves_with_paths(back):
        assert torch.equal(w, trained[p]), p
    toks = torch.randint(0, cfg.vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = adapters.adapt(llama.forward, lc, stored)(sharding.named_tree(params, decls),
                                                         fpp.wrap(toks, "batch seq"), cfg).value()
        theirs = llama.forward(sharding.named_tree(back, llama.init(cfg)), fpp.wrap(toks, "batch seq"), cfg).value()
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
