"""Remote-code checkpoints (``trust_remote_code``) read onto the decoder (models/remote_code_hf.py):
Qwen (v1) (``QWenLMHeadModel``: ``c_attn``, ``w1`` / ``w2`` / ``c_proj``), MiMo (``MiMoForCausalLM``:
Qwen2 plus multi-token-prediction layers its forward never calls) and Replit's MPT (``ln_1``,
``mlp.mlp_up``, ...), each written in its hub layout (tests/remote_layouts.py) from a tiny random
transformers model of the same math (``Qwen2ForCausalLM``, ``MptForCausalLM``), which is the oracle:
logits, fp64 loss and every gradient, LoRA written with the remote module names = peft on the
transformers model, export back to the remote layout bit-exact (MiMo's MTP layers copied), the
refusals, and two AdamW steps on gloo processes (FSDP x TP) = one device."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from harness import assert_processes_equal_one_device, make_batch, our_logits, single_device, tokens
from remote_layouts import mimo_from_qwen2, qwen_v1_from_qwen2, replit_from_mpt
from safetensors import safe_open

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")


def _qwen2(tie: bool = False):
    torch.manual_seed(0)
    conf = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                    tie_word_embeddings=tie, rope_theta=20000.0, bos_token_id=None, eos_token_id=None,
                                    attn_implementation="eager")
    model = transformers.Qwen2ForCausalLM(conf).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model = _qwen2()
    return model, qwen_v1_from_qwen2(model, tmp_path_factory.mktemp("qwen") / "m", seq_length=32)


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    model = _qwen2()
    return model, mimo_from_qwen2(model, tmp_path_factory.mktemp("mimo") / "m", mtp_layers=1)


@pytest.fixture(scope="module")
def replit(tmp_path_factory):
    torch.manual_seed(0)
    conf = transformers.MptConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
                                  bos_token_id=None, eos_token_id=None)
    model = transformers.MptForCausalLM(conf).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
    return model, replit_from_mpt(model, tmp_path_factory.mktemp("replit") / "m")


REFERENCE = {"qwen": "qwen2", "mimo": "qwen2", "replit": "mpt"}     # (the transformers family of the same math)
INTERNAL = {"qwen": "qwen", "mimo": "mimo", "replit": "replit_mpt"}


def _tensors(d) -> dict[str, torch.Tensor]:
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_qwen_config_is_qwen2s_layer():
    d = json.loads(json.dumps(dict(model_type="qwen", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                   vocab_size=256, kv_channels=16, intermediate_size=96, seq_length=32,
                                   max_position_embeddings=128, rotary_emb_base=5000, layer_norm_epsilon=1e-5)))
    cfg = hf.config_from_hf(d)
    assert (cfg.mlp, cfg.kv_heads, cfg.qkv_bias, cfg.o_bias, cfg.rope_theta, cfg.norm_eps, cfg.max_seq,
            cfg.tie_embeddings) == (48, 4, True, False, 5000.0, 1e-5, 32, False)
    # (without dynamic NTK and log-n scaling the positions are max_position_embeddings)
    assert hf.config_from_hf(dict(d, use_dynamic_ntk=False, use_logn_attn=False)).max_seq == 128


@pytest.mark.parametrize("extra, msg", [
    (dict(no_bias=False), r"no_bias=False is not supported"),
    (dict(rotary_pct=0.5), r"rotary_pct=0.5 is not supported"),
    (dict(emb_dropout_prob=0.1), r"emb_dropout_prob=0.1 is not supported"),
    (dict(kv_channels=8), r"kv_channels=8 x num_attention_heads=4 must equal hidden_size=64"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), r"rope_scaling=.* is not supported")])
def test_qwen_refusals_name_the_key(extra, msg):
    base = dict(model_type="qwen", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256,
                kv_channels=16, intermediate_size=96)
    with pytest.raises(ck.CheckpointMismatchError, match=rf"HF qwen config: {msg}"):
        hf.config_from_hf(dict(base, **extra))


@pytest.mark.parametrize("which", ["qwen", "mimo", "replit"])
def test_logits_equal_transformers(which, request):
    model, d = request.getfixturevalue(which)
    cfg, params = hf.load_hf_llama(d)
    assert cfg.model_type == INTERNAL[which] and (cfg.mtp_layers == (1 if which == "mimo" else 0))
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("which", ["qwen", "mimo", "replit"])
def test_fp64_loss_and_every_gradient_equal_transformers(which, request):
    import copy
    import dataclasses
    model, d = request.getfixturevalue(which)
    ref = copy.deepcopy(model).double()
    cfg, params = hf.load_hf_llama(d, dtype=torch.float64)
    batch = make_batch(cfg, batch=3, seq=12, seed=2)
    loss, grads = single_device(cfg, params, batch)
    want = F.cross_entropy(ref(input_ids=batch["tokens"]).logits.reshape(-1, cfg.vocab), batch["labels"].reshape(-1))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)     # (transformers' rotary table: fp32)
    ours = dict(tree.leaves_with_paths(grads))
    as_ref = dataclasses.replace(cfg, model_type=REFERENCE[which], mtp_layers=0)   # (transformers' names of our paths)
    files = dict(hf._file_tensors(llama.init(as_ref), as_ref))
    for name, p in ref.named_parameters():
        parts = files[name]
        g = hf.fuse_rows([kind.to_hf(ours[q]) for q, kind, _ in parts], as_ref, getattr(parts[0][1], "row_axis", 0))
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("which", ["qwen", "mimo", "replit"])
def test_export_writes_the_remote_layout_back_bit_exactly(which, request, tmp_path):
    """Import then export: the same tensor names and bits (MiMo's MTP layers, unread, copied from
    ``base_model``), the config's keys as the hub's, ``auto_map`` included."""
    _, d = request.getfixturevalue(which)
    cfg, params = hf.load_hf_llama(d)
    copied = []
    out = hf.save_hf_llama(params, cfg, tmp_path / "out", base_model=d, copied=copied)
    before, after = _tensors(d), _tensors(out)
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    assert sorted(copied) == sorted(k for k in before if ".mtp_layers." in k) and (which == "mimo") == bool(copied)
    theirs, ours = json.loads((d / "config.json").read_text()), json.loads((out / "config.json").read_text())
    keys = ["architectures", "auto_map", "model_type", "vocab_size"] + {
        "qwen": ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "tie_word_embeddings",
                 "kv_channels", "layer_norm_epsilon", "rotary_emb_base", "seq_length", "no_bias"],
        "mimo": ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "tie_word_embeddings",
                 "num_nextn_predict_layers", "rms_norm_eps", "num_key_value_heads"],
        "replit": ["d_model", "n_layers", "n_heads", "expansion_ratio", "no_bias", "max_seq_len", "norm_type"]}[which]
    assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}
    assert hf.load_hf_llama(out)[0] == cfg


@pytest.mark.parametrize("which, remote, ours", [
    ("qwen", ["c_attn", "c_proj", "w1", "w2"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"]),
    ("replit", ["out_proj", "mlp_up", "mlp_down"], ["out_proj", "up_proj", "down_proj"])])
def test_lora_on_remote_names_equals_peft_on_transformers(which, remote, ours, request):
    """``lora_target_modules`` written with the remote module names (Qwen (v1)'s ``c_attn`` ... ``w2``,
    Replit's ``mlp_up`` / ``mlp_down``) adapt those weights: one step's loss and every adapter gradient
    equal peft's on the transformers model with its own names."""
    import copy

    import peft

    from functional_pp import adapters
    from functional_pp.adapters import peft_dir
    from functional_pp.adapters.peft_fused import model_type_of, part_names
    from harness import train_adapters
    model, d = request.getfixturevalue(which)
    pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=ours))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn_like(p))
    cfg = hf.config_from_hf(d)
    assert model_type_of(str(d)) == cfg.model_type == INTERNAL[which]
    names = part_names(remote, cfg.model_type)
    assert sorted(names) == sorted(n.replace("out_proj", "o_proj") for n in ours)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=names)
    decls = adapters.init(llama.init(cfg), lc)
    state = {k.replace(".default", ""): v.detach().clone() for k, v in pm.state_dict().items() if "lora_" in k}
    full = adapters.joined(hf.load_hf_params(d, cfg), peft_dir.from_peft(state, decls, REFERENCE[which]))
    batch = make_batch(cfg, batch=2, seq=12, seed=3)
    got = train_adapters(cfg, lc, decls, full, [batch], fpp.Mesh(), fpp.Rules(), 1e-2, 0.1)[0]
    logits = pm(input_ids=batch["tokens"]).logits
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    ref.backward()
    torch.testing.assert_close(torch.tensor(float(got[0][0])), ref.detach().reshape(()), rtol=1e-5, atol=1e-6)
    grads = peft_dir.to_peft(got[1], REFERENCE[which])
    want = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if p.requires_grad}
    assert grads.keys() == want.keys() and len(want) == 2 * len(ours) * cfg.layers
    for k in want:
        torch.testing.assert_close(grads[k], want[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {k}: {m}")
    if which == "replit":        # (the adapters' PEFT names are the remote model's modules: mlp.mlp_up; Qwen's
        remote_names = peft_dir.to_peft(got[1], cfg.model_type)     # c_attn: one fused adapter, adapters/peft_fused.py)
        assert all(any(f".{r}." in k for r in remote) for k in remote_names), sorted(remote_names)[:4]


def test_an_mpt_with_transformers_names_stays_mpt(tmp_path):
    """The files decide: an ``mpt`` config.json (with ``auto_map`` too) over transformers' names is
    ``mpt``; over Replit's, ``replit_mpt``."""
    import shutil

    from remote_layouts import REPLIT_AUTO_MAP
    torch.manual_seed(0)
    model = transformers.MptForCausalLM(transformers.MptConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4))
    model.save_pretrained(tmp_path / "t")
    conf = json.loads((tmp_path / "t" / "config.json").read_text())
    (tmp_path / "t" / "config.json").write_text(json.dumps(dict(conf, auto_map=REPLIT_AUTO_MAP)))
    assert hf.config_from_hf(tmp_path / "t").model_type == "mpt"
    replit_from_mpt(model, tmp_path / "r")
    assert hf.config_from_hf(tmp_path / "r").model_type == "replit_mpt"
    shutil.rmtree(tmp_path / "r")


def test_real_processes_equal_one_device(qwen):
    """Two AdamW steps of the Qwen (v1) config on four gloo processes (FSDP x TP) equal one device's."""
    import dataclasses
    cfg = dataclasses.replace(hf.config_from_hf(qwen[1]), vocab=64, layers=1)
    assert_processes_equal_one_device(cfg)


def test_a_tiktoken_vocabulary_alone_is_refused_naming_it(tmp_path):
    """Qwen (v1)'s repository holds ``qwen.tiktoken`` (read by its remote tokenizer), no tokenizer.json."""
    from functional_pp.data.tokenizer import find_tokenizer_file
    (tmp_path / "qwen.tiktoken").write_text("")
    with pytest.raises(FileNotFoundError, match=r"holds qwen.tiktoken, a tiktoken vocabulary read by remote code"):
        find_tokenizer_file(tmp_path)


def test_mimo_refusals_and_its_mtp_layers_only_in_its_class():
    """MiMo with sliding windows is refused by name; MTP layers have no Qwen2ForCausalLM equivalent."""
    import dataclasses
    base = dict(model_type="mimo", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                vocab_size=256, intermediate_size=96, num_nextn_predict_layers=1)
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF mimo config: use_sliding_window=True is not supported"):
        hf.config_from_hf(dict(base, use_sliding_window=True))
    cfg = hf.config_from_hf(base)
    assert cfg.mtp_layers == 1 and hf.config_to_hf(cfg)["num_nextn_predict_layers"] == 1
    with pytest.raises(ValueError, match=r"mtp_layers=1 has no Qwen2ForCausalLM equivalent"):
        hf.config_to_hf(dataclasses.replace(cfg, model_type="qwen2"))
