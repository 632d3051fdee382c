"""LoRA against peft + transformers (the oracle): tiny random Llama, Qwen3, OLMo 2, Cohere, Gemma, GLM-4,
Gemma 4, StarCoder 2, Nemotron and GPT-2 models built from a
config (no download), the same initial adapter weights (B nonzero, so every adapter gradient is
meaningful), fp32: the loss, every adapter gradient and the adapters after one AdamW step equal
peft's; every layout (DP, FSDP, TP, FSDP x TP, simulated) equals one device; the PEFT adapter
directory round-trips through ``peft.PeftModel.from_pretrained`` and the merged model through
``transformers`` with equal logits (docs/adapters.md)."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from harness import adapted_logits, assert_adapter_layouts_equal_one_device, make_batch, train_adapters

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.adapters import peft_dir
from functional_pp.checkpoint import hf
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=128)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", BASE),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(BASE, head_dim=32)),
            # norms after each block, q/k norms over every head; attention and MLP in parallel
            # (LayerNorm, interleaved rotary, a logit scale)
            "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(BASE, pad_token_id=None, eos_token_id=None)),
            "cohere": ("CohereConfig", "CohereForCausalLM", dict(
                {k: v for k, v in BASE.items() if k != "rms_norm_eps"}, logit_scale=0.5, pad_token_id=None,
                eos_token_id=None)),
            # RMSNorms of 1 + w, tanh-GELU GLU; q/k/v biases, interleaved partial rotary, sandwich norms;
            # LayerNorms, biases, an MLP not gated (c_fc / c_proj); LayerNorm1P, squared ReLU
            "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(BASE, head_dim=16, pad_token_id=None)),
            "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(BASE, head_dim=16, pad_token_id=None)),
            # ERNIE 4.5: interleaved rotary over the whole head, biases on every linear (the gate's too)
            "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(BASE, head_dim=16, use_bias=True,
                                                                       pad_token_id=None)),
            "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
                BASE, bos_token_id=None, eos_token_id=None)),     # (its window: test_hf_families_more.py)
            "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(BASE, bos_token_id=None, eos_token_id=None)),
            # Gemma 4: full layers of their own widths whose v is the k projection (no v_proj to adapt there)
            "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
                BASE, head_dim=16, global_head_dim=32, num_global_key_value_heads=2, attention_k_eq_v=True,
                sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=30.0, pad_token_id=None,
                bos_token_id=None, eos_token_id=None)),
            # learned positions (not adapted: a table), Conv1D weights, c_proj of attention and of the MLP
            "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                                          n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                                          attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# peft's module names where a family's differ from ours (and the modules it lacks: gate_proj of an MLP
# that is not gated; GLM's gate and up are one fused module, adapted apart: tests/adapters/test_peft_phi3.py)
PEFT_NAMES = {"starcoder2": {"up_proj": "c_fc", "down_proj": "c_proj", "gate_proj": None},
              "nemotron": {"gate_proj": None},
              "gpt2": {"gate_proj": None, "up_proj": "c_fc", "down_proj": "mlp.c_proj", "o_proj": "attn.c_proj",
                       "q_proj": None, "k_proj": None, "v_proj": None}, "glm4": {"gate_proj": None, "up_proj": None}}
MODEL_TYPES = {"gpt2": "gpt2", "gemma": "gemma", "glm4": "glm4", "ernie4_5": "ernie4_5", "starcoder2": "starcoder2", "nemotron": "nemotron"}


def _targets(family: str) -> tuple[tuple[str, ...], list[str]]:
    """(our target modules, peft's) of ``family``."""
    names = PEFT_NAMES.get(family, {})
    ours = tuple(t for t in TARGETS if names.get(t, t) is not None)
    return ours, [names.get(t, t) for t in ours]
LR, WD = 1e-2, 0.1


def _lora(rslora=False, family="llama"):
    return adapters.LoraConfig(r=4, alpha=8, target_modules=_targets(family)[0], rslora=rslora)


def _peft_model(family, rslora=False):
    conf, cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, conf)(**kw)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=_targets(family)[1],
                                                    use_rslora=rslora))
    with torch.no_grad():             # B nonzero: A's gradients are not zero
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return pm, base_state


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    family = request.param
    pm, base_state = _peft_model(family)
    d = tmp_path_factory.mktemp(family)
    pm.get_base_model().config.save_pretrained(d)
    from safetensors.torch import save_file
    save_file(base_state, str(d / "model.safetensors"))
    cfg = hf.config_from_hf(d)
    lc = _lora(family=family)
    decls = adapters.init(llama.init(cfg), lc)
    base = hf.load_hf_params(d, cfg)
    adapter_sd = {k.replace(".default", ""): v.detach().clone() for k, v in pm.state_dict().items() if "lora_" in k}
    full = adapters.joined(base, peft_dir.from_peft(adapter_sd, decls, MODEL_TYPES.get(family, "llama")))
    return family, pm, cfg, lc, decls, full, d


def _hf_loss(pm, batch):
    logits = pm(input_ids=batch["tokens"]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


def test_loss_gradients_and_update_equal_peft(case):
    family, pm, cfg, lc, decls, full, _ = case
    batch = make_batch(cfg, batch=2, seq=12, seed=3)
    ours = train_adapters(cfg, lc, decls, full, [batch], fpp.Mesh(), fpp.Rules(), LR, WD)[0]
    ref = _hf_loss(pm, batch)
    ref.backward()
    trainable = [p for p in pm.parameters() if p.requires_grad]
    ref_grads = {k.replace(".default", ""): p.grad.clone() for k, p in pm.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    opt.step()
    ref_new = {k.replace(".default", ""): p.detach() for k, p in pm.named_parameters() if p.requires_grad}
    torch.testing.assert_close(torch.tensor(float(ours[0][0])), ref.detach().reshape(()), rtol=1e-5, atol=1e-6)
    ours_grads = peft_dir.to_peft(ours[1], cfg.model_type)
    ours_new = peft_dir.to_peft(ours[2], cfg.model_type)
    shared_v = sum(cfg.v_shared(i) for i in range(cfg.layers)) if "v_proj" in lc.target_modules else 0   # (Gemma 4)
    assert ours_grads.keys() == ref_grads.keys()
    assert len(ref_grads) == 2 * (len(lc.target_modules) * cfg.layers - shared_v)
    for k in ref_grads:
        assert ref_grads[k].abs().max() > 0, k
        torch.testing.assert_close(ours_grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {k}: {m}")
        torch.testing.assert_close(ours_new[k], ref_new[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"new {k}: {m}")


def test_every_layout_equals_one_device(case):
    family, pm, cfg, lc, _, full, _ = case
    assert_adapter_layouts_equal_one_device(cfg, lc, full)


def test_peft_directory_loads_in_peft(case, tmp_path):
    """Our adapters written as a PEFT directory (each family's module names: StarCoder 2's
    ``c_fc``, GPT-2's Conv1D ``c_proj`` of attention and of the MLP, ...) load in
    ``peft.PeftModel.from_pretrained`` with our adapted logits, and read back
    (``lora_model_dir``) to the same tensors."""
    family, _, cfg, lc, decls, full, d = case
    base, lora = adapters.split(full)
    out = peft_dir.save_adapter(tmp_path / "adapter", lora, lc, str(d), base=base)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    loaded = peft.PeftModel.from_pretrained(model, str(out)).eval()
    tokens = torch.randint(0, cfg.vocab, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = loaded(input_ids=tokens).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        assert (theirs - plain(input_ids=tokens).logits).abs().max() > 1e-3          # the adapters act
        torch.testing.assert_close(theirs, adapted_logits(base, lora, decls, lc, cfg, tokens), rtol=1e-5, atol=1e-5)
    back = peft_dir.load_adapter(out, decls, lc, str(d))
    assert back.keys() == lora.keys()
    for p, ab in lora.items():
        assert all(torch.equal(back[p][k], ab[k]) for k in ab), p


def test_gpt2_fused_c_attn_adapters_round_trip_through_peft(tmp_path):
    """GPT-2's q, k and v are one Conv1D ``c_attn``: our adapters of q_proj, k_proj and v_proj
    export as one rank-3r adapter of it (A stacked, B block-diagonal, its scale kept through
    ``rank_pattern`` / ``alpha_pattern``) that peft loads (``fan_in_fan_out``) with our adapted
    logits, and that reads back to the same tensors; an adapter peft trained on ``c_attn`` (one A
    shared by q, k and v) reads as ours with peft's logits."""
    from harness import random_lora
    torch.manual_seed(0)
    conf, cls, kw = FAMILIES["gpt2"]
    model = getattr(transformers, cls)(getattr(transformers, conf)(**kw)).float()
    d = tmp_path / "gpt2"
    model.save_pretrained(d)
    cfg, base = hf.load_hf_llama(d)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "up_proj"))
    decls = adapters.init(llama.init(cfg), lc)
    lora = random_lora(decls, torch.Generator().manual_seed(1))
    out = peft_dir.save_adapter(tmp_path / "adapter", lora, lc, str(d), base=base)
    conf_json = json.loads((out / "adapter_config.json").read_text())
    assert conf_json["rank_pattern"] == {f"transformer.h.{i}.attn.c_attn": 12 for i in range(cfg.layers)}
    tokens = torch.randint(0, cfg.vocab, (2, 10), generator=torch.Generator().manual_seed(5))
    plain = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    loaded = peft.PeftModel.from_pretrained(plain, str(out)).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=tokens).logits
    ours = adapted_logits(base, lora, decls, lc, cfg, tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    back = peft_dir.load_adapter(out, decls, lc, str(d))
    assert back.keys() == lora.keys()
    for p, ab in lora.items():
        assert all(torch.equal(back[p][k], ab[k]) for k in ab), p
    # peft's own adapter of c_attn (rank r, A shared by q, k and v), B nonzero
    pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                   target_modules=["c_attn"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    pm.save_pretrained(tmp_path / "theirs")
    lc3 = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "k_proj", "v_proj"))
    decls3 = adapters.init(llama.init(cfg), lc3)
    read = peft_dir.load_adapter(tmp_path / "theirs", decls3, lc3, str(d))
    assert torch.equal(read["layers.0.self_attn.q_proj"]["lora_A"], read["layers.0.self_attn.v_proj"]["lora_A"])
    with torch.no_grad():
        want = pm.eval()(input_ids=tokens).logits
        assert (want - model.eval()(input_ids=tokens).logits).abs().max() > 1e-3        # the adapters act
    torch.testing.assert_close(adapted_logits(base, read, decls3, lc3, cfg, tokens), want, rtol=1e-5, atol=1e-5)
