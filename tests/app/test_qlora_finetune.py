"""The QLoRA fine-tune of examples/configs/qlora.yaml (a tiny Qwen3 made by
examples/make_tiny_hf_qwen3.py, nothing downloaded): 2 steps through the CLI with the base's
linear weights held as NF4 codes (frozen, saved as codes), the adapters trained, and
``export --merge-adapter`` writing a plain HF model (dequantized base + merged adapters) whose
logits in ``transformers`` equal ours."""
import json

import optree
import pytest
import torch
from harness import run_lora_config, tiny_qwen3_finetune

import functional_pp as fpp
from functional_pp import adapters
from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.checkpoint import hf
from functional_pp.models import llama
from functional_pp.models.quantize import quantized_decls
from functional_pp.parallel import sharding
from functional_pp.quant.weights import QuantizedWeight

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def _is_q(x):
    return isinstance(x, QuantizedWeight)


# head_dim 64: every weight blocked; head_dim 16: o_proj in bitsandbytes' flat form (issue 47), exported too
@pytest.fixture(scope="module", params=["tiny-qwen3-hd64", "tiny-qwen3"])
def run(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("qlora")
    return (*tiny_qwen3_finetune(root, "qlora.yaml", request.param, "max_steps=2", "save_steps=2",
                                 "eval_steps=2"), root)


def test_trains_adapters_over_nf4_codes_and_exports_a_merged_hf_model(run):
    base_dir, out, root = run
    cfg = hf.config_from_hf(base_dir)
    lc = run_lora_config(out)
    decls = quantized_decls(adapters.init(llama.init(cfg), lc), "nf4", double_quant=True)
    params = ck.load_checkpoint(out / "checkpoints", {"params": decls}, keys=["params"]).tree["params"]
    base, lora = adapters.split(params)
    codes = [x for x in optree.tree_leaves(base, is_leaf=_is_q, none_is_leaf=False) if _is_q(x)]
    assert len(codes) == 7 * cfg.layers and all(q.codes.dtype == torch.uint8 for q in codes)
    assert all(ab["lora_B"].abs().max() > 0 for ab in lora.values()) and len(lora) == 7 * cfg.layers
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 2
    merged_dir = root / "merged"
    assert cli.main(["export", "--merge-adapter", str(out), str(merged_dir)]) == 0
    toks = torch.randint(0, cfg.vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = adapters.adapt(llama.forward, lc)(sharding.named_tree(params, decls), fpp.wrap(toks, "batch seq"),
                                                 cfg).value()
        model = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        theirs = model(input_ids=toks).logits
    assert type(model).__name__ == "Qwen3ForCausalLM"
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
