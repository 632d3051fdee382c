"""Adapters of Phi-3's fused modules: our LoRA / DoRA of the split weights (q/k/v_proj,
gate/up_proj) exported as a PEFT directory with one exact adapter per fused module (``qkv_proj``,
``gate_up_proj``: A stacked, B block-diagonal, the rank and alpha per module), which
``peft.PeftModel.from_pretrained`` loads on ``Phi3ForCausalLM`` with logits equal to ours
(docs/adapters.md "PEFT adapter directories")."""
import json

import pytest
import torch
from harness import adapted_logits, random_lora
from safetensors.torch import load_file

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.adapters import peft_dir
from functional_pp.adapters.dora import full_row_norm
from functional_pp.checkpoint import hf
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HF = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=128, pad_token_id=None)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**HF)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("phi3")
    model.save_pretrained(d)
    return d, hf.config_from_hf(d)


@pytest.mark.parametrize("lc", [adapters.LoraConfig(r=4, alpha=8, target_linear=True),
                                adapters.LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj", "up_proj",
                                                                                  "o_proj"), rslora=True, dora=True)],
                         ids=["lora", "dora_partial"])
def test_fused_adapter_directory_gives_our_logits(phi3, lc, tmp_path):
    d, cfg = phi3
    decls = adapters.init(llama.init(cfg), lc)
    base = hf.load_hf_params(d, cfg)
    g = torch.Generator().manual_seed(1)
    lora = {}
    for path, ab in adapters.split(fpp.init(lambda: decls, seed=0))[1].items():
        a, b = ab["lora_A"].data, 0.1 * torch.randn(ab["lora_B"].data.shape, generator=g)
        lora[path] = {"lora_A": a, "lora_B": b}
        if lc.dora:         # the magnitudes off the norms, so that they matter
            w = map_with_path(lambda p, x: x, base)
            w = dict(fpp.leaves_with_paths(w))[path]
            m = full_row_norm(w, a, b, lc.scale)
            lora[path]["lora_magnitude"] = m * (1 + 0.1 * torch.rand(m.shape, generator=g))
    full = adapters.joined(base, lora)
    tokens = torch.randint(0, cfg.vocab, (2, 12), generator=g)
    with torch.no_grad():
        ours = adapters.adapt(llama.forward, lc)(sharding.named_tree(full, decls), fpp.wrap(tokens, "batch seq"),
                                                 cfg).value()
        out = peft_dir.save_adapter(tmp_path / "adapter", lora, lc, str(d), base=base)
        conf = json.loads((out / "adapter_config.json").read_text())
        fused = {"qkv_proj", "gate_up_proj"} & set(conf["target_modules"])
        assert fused == {"qkv_proj", "gate_up_proj"}
        assert not {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} & set(conf["target_modules"])
        n = 3 if not lc.dora else 2                      # (dora_partial: q and v of q/k/v)
        assert conf["rank_pattern"]["model.layers.0.self_attn.qkv_proj"] == n * lc.r
        model = transformers.Phi3ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        loaded = peft.PeftModel.from_pretrained(model, str(out)).eval()
        plain = transformers.Phi3ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        theirs = loaded(input_ids=tokens).logits
        assert (theirs - plain(input_ids=tokens).logits).abs().max() > 1e-3      # the adapters act
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # read back (lora_model_dir): the same adapters exactly, and written again the same files
    back = peft_dir.load_adapter(out, decls, lc, str(d))
    assert back.keys() == lora.keys()
    for p, ab in lora.items():
        assert back[p].keys() == ab.keys() and all(torch.equal(back[p][k], ab[k]) for k in ab), p
    again = peft_dir.save_adapter(tmp_path / "again", back, lc, str(d), base=base)
    assert json.loads((again / "adapter_config.json").read_text()) == conf
    first, second = (load_file(str(x / "adapter_model.safetensors")) for x in (out, again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    if lc.dora:     # the directory's own config targets all of q/k/v: k's zero rows make 2r no 3 x r split
        with pytest.raises(ValueError, match="has rank 4; the run's adapters of its parts"):
            peft_dir.load_adapter(out, adapters.init(llama.init(cfg), peft_dir.read_config(out)), lc, str(d))
    else:
        assert peft_dir.read_config(out).target_modules == ("down_proj", "gate_proj", "up_proj", "o_proj",
                                                           "q_proj", "k_proj", "v_proj")
    with pytest.raises(ValueError, match="fused phi3 module: pass the full base tree"):
        peft_dir.save_adapter(tmp_path / "again", lora, lc, str(d))


@pytest.mark.parametrize("kind", ["lora", "rslora_dora"])
def test_lora_model_dir_reads_a_peft_trained_phi3_adapter_with_peft_logits(phi3, kind, tmp_path):
    """An adapter peft made on the fused modules (one A shared by q, k and v) starts a run
    (``lora_model_dir`` with the fused names as ``lora_target_modules``): each part gets a copy
    of A and its rows of B, and the logits equal ``peft.PeftModel``'s."""
    from functional_pp.app.inputs import adapter_params, frozen_and_adapters
    from functional_pp.config import ConfigError, TrainConfig
    d, cfg = phi3
    dora = kind == "rslora_dora"
    torch.manual_seed(2)
    model = transformers.Phi3ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    pc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                         init_lora_weights=False, use_rslora=dora, use_dora=dora)
    theirs_model = peft.get_peft_model(model, pc).eval()
    if dora:     # magnitudes off the norms, so that they matter
        with torch.no_grad():
            for n, p in theirs_model.named_parameters():
                if "lora_magnitude" in n:
                    p.mul_(1 + 0.1 * torch.rand_like(p))
    theirs_model.save_pretrained(tmp_path / "adapter")
    tokens = torch.randint(0, cfg.vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = theirs_model(input_ids=tokens).logits
    run = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "base_model": str(d), "peft_use_rslora": dora,
           "peft_use_dora": dora, "lora_target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
           "lora_model_dir": str(tmp_path / "adapter")}
    tc = TrainConfig.from_dict(run)
    lc = tc.lora_config()
    assert lc.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    _, decls, _ = frozen_and_adapters(tc, lc, None, llama.init(cfg))
    mesh, rules = fpp.Mesh(), fpp.Rules()
    lora = fpp.launch(lambda: adapter_params(tc, decls, mesh, rules), mesh)[0]
    lora = {p: {k: x.data for k, x in ab.items()} for p, ab in lora.items()}
    q, k = lora["layers.0.self_attn.q_proj"], lora["layers.0.self_attn.k_proj"]
    assert torch.equal(q["lora_A"], k["lora_A"])          # (one A shared: copies)
    full = adapters.joined(hf.load_hf_params(d, cfg), lora)
    with torch.no_grad():
        ours = adapters.adapt(llama.forward, lc)(sharding.named_tree(full, decls), fpp.wrap(tokens, "batch seq"),
                                                 cfg).value()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    if dora:
        return
    # another scale, another rank, a part left out: refused by name
    for change, match in [({"lora_alpha": 16}, "is scaled"), ({"lora_r": 3, "lora_alpha": 6}, "has rank 4"), ({"lora_r": 2, "lora_alpha": 4}, "not block-diagonal"),
                          ({"lora_target_modules": ["q_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]},
                           "rows of layers.0.self_attn.k_proj are nonzero")]:
        bad = TrainConfig.from_dict({**run, **change})
        _, bad_decls, _ = frozen_and_adapters(bad, bad.lora_config(), None, llama.init(cfg))
        with pytest.raises(ConfigError, match=match):
            adapter_params(bad, bad_decls, mesh, rules)


def test_renamed_modules_adapter_directory_gives_our_logits(tmp_path):
    """Phi-1/2 names its output projection ``dense`` and its MLP ``fc1`` / ``fc2``: our LoRA of
    o_proj / up_proj / down_proj exports under those names, ``peft`` loads it on
    ``PhiForCausalLM`` with logits equal to ours, and it reads back (target modules in our names)."""
    torch.manual_seed(0)
    kw = {k: v for k, v in HF.items() if k != "rms_norm_eps"}
    model = transformers.PhiForCausalLM(transformers.PhiConfig(**kw)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    d = tmp_path / "phi"
    model.save_pretrained(d)
    cfg = hf.config_from_hf(d)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "o_proj", "up_proj", "down_proj"))
    decls = adapters.init(llama.init(cfg), lc)
    base = hf.load_hf_params(d, cfg)
    g = torch.Generator().manual_seed(1)
    lora = random_lora(decls, g)
    tokens = torch.randint(0, cfg.vocab, (2, 12), generator=g)
    ours = adapted_logits(base, lora, decls, lc, cfg, tokens)
    with torch.no_grad():
        out = peft_dir.save_adapter(tmp_path / "adapter", lora, lc, str(d))
        assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["dense", "fc1", "fc2",
                                                                                         "q_proj"]
        loaded = peft.PeftModel.from_pretrained(transformers.PhiForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager"), str(out)).eval()
        plain = transformers.PhiForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        theirs = loaded(input_ids=tokens).logits
        assert (theirs - plain(input_ids=tokens).logits).abs().max() > 1e-3      # the adapters act
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert set(peft_dir.read_config(out).target_modules) == set(lc.target_modules)
    back = peft_dir.load_adapter(out, decls, lc, str(d))
    assert back.keys() == lora.keys() and all(torch.equal(back[p]["lora_B"], lora[p]["lora_B"]) for p in lora)
