"""``modules_to_save`` in a PEFT adapter directory: the modules trained whole are written under
their Hugging Face names in its layout (``base_model.model.lm_head.weight``, as peft writes
them), ``peft.PeftModel.from_pretrained`` loads the directory with logits equal to ours, and
``lora_model_dir`` reads them back exactly (docs/adapters.md "PEFT adapter directories")."""
import json

import pytest
import torch
from harness import adapted_logits, random_lora

from functional_pp import adapters
from functional_pp.adapters import peft_dir
from functional_pp.checkpoint import hf
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def test_modules_to_save_are_written_as_peft_writes_them(tmp_path):
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(hf_cfg).float().save_pretrained(tmp_path / "base")
    cfg = hf.config_from_hf(tmp_path / "base")
    lc = adapters.LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj"),
                             modules_to_save=("lm_head", "embed_tokens"))
    decls = adapters.init(llama.init(cfg), lc)
    g = torch.Generator().manual_seed(1)
    base = hf.load_hf_params(tmp_path / "base", cfg)
    base = map_with_path(lambda p, x: x + 0.1 * torch.randn(x.shape, generator=g)    # (trained whole)
                         if p in ("lm_head", "embed_tokens") else x, base)
    lora = random_lora(decls, g)
    tokens = torch.randint(0, cfg.vocab, (2, 10), generator=g)
    ours = adapted_logits(base, lora, decls, lc, cfg, tokens)
    with torch.no_grad():
        out = peft_dir.save_adapter(tmp_path / "adapter", lora, lc, str(tmp_path / "base"), base=base)
        assert json.loads((out / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head", "embed_tokens"]
        model = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32,
                                                              attn_implementation="eager")
        theirs = peft.PeftModel.from_pretrained(model, str(out)).eval()(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="modules_to_save .* are trained whole: pass the full base tree"):
        peft_dir.save_adapter(tmp_path / "again", lora, lc, str(tmp_path / "base"))
    # read back (lora_model_dir): the adapters and the modules trained whole, exactly
    back = peft_dir.load_adapter(out, decls, lc, str(tmp_path / "base"))
    assert all(torch.equal(back[p][k], lora[p][k]) for p in lora for k in lora[p])
    saved = peft_dir.load_saved_modules(out, decls, lc, str(tmp_path / "base"))
    assert saved.keys() == {"lm_head", "embed_tokens"}
    assert all(torch.equal(saved[p], base[p]) for p in saved)
    with pytest.raises(ValueError, match="match no adapter of the config .* nor its modules_to_save"):
        peft_dir.load_adapter(out, decls, adapters.LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj")),
                              str(tmp_path / "base"))
