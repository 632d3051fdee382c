"""``peft_use_dora: true`` through the CLI: examples/configs/lora.yaml (a tiny Qwen3, FSDP 2 x TP 2
on 4 simulated devices) with DoRA for 2 steps; the loop initialises each magnitude from the
sharded base (its weight's norms, not the declared ones), and both exports agree: the PEFT
directory (``use_dora``) loaded by ``peft`` and the merged model give equal logits
(docs/adapters.md "DoRA")."""
import json

import pytest
import torch
from harness import tiny_qwen3_finetune

from functional_pp import cli

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("tokenizers")


def test_dora_run_exports_agree_and_magnitudes_start_at_the_norms(tmp_path):
    base_dir, out = tiny_qwen3_finetune(tmp_path, "lora.yaml", "tiny-qwen3", "peft_use_dora=true", "max_steps=2",
                                        "save_steps=2", "val_set_size=0")
    assert cli.main(["export", str(out), str(tmp_path / "adapter")]) == 0
    assert cli.main(["export", "--merge-adapter", str(out), str(tmp_path / "merged")]) == 0
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["use_dora"]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    norms = base.model.layers[0].self_attn.q_proj.weight.detach().norm(dim=1)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tokens = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, merged(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
    m = loaded.base_model.model.model.layers[0].self_attn.q_proj.lora_magnitude_vector["default"].weight.detach()
    # two AdamW steps (each moves an entry by at most about lr = 1e-2) from the norms (~0.15), far from 1
    assert (m - norms).abs().max() < 2.5e-2 and not torch.equal(m, norms) and norms.max() < 0.5
