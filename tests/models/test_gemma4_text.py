"""Gemma 4's text decoder (``gemma4_text``, and the text decoder of the multimodal ``gemma4``) as
a configuration of the one decoder (models/llama.py, models/gemma4_hf.py): norms scaling by w,
q/k norms and a weightless v norm, no softmax scale, full layers with their own head width and
k/v heads whose v is the k projection (``attention_k_eq_v``), proportional rope there and a
local rope base in the sliding layers, a per-layer output scalar, soft-capped logits. A tiny
random model transformers builds from a config loads through the HF import; logits, loss and
every gradient equal transformers'; export writes ``Gemma4ForCausalLM``, which loads with equal
logits; FSDP x TP with sequence parallelism and CP on simulated devices, and FSDP x TP on real
gloo processes, equal one device; a multimodal ``Gemma4ForConditionalGeneration`` checkpoint
loads its text decoder (the vision tower left aside) with transformers' text-only logits."""
import dataclasses
import json

import pytest
import torch
from harness import (assert_export_round_trip, assert_hf_layout_equals_one_device, fp64_beside_hf,
                     import_logits_beside_hf, our_logits, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4ForCausalLM"):
    pytest.skip("transformers without Gemma 4", allow_module_level=True)

# windows shorter than the 12-token sequences; full layers of their own widths (k_eq_v), the last full
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
              attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=128)
EAGER = dict(attn_implementation="eager")


def _randomize(model) -> None:
    """O(1) logits; q/k norms below 1 (Gemma 4's softmax has no 1/sqrt(d) scale); layer scalars off 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            p.copy_(0.4 + 0.05 * torch.randn_like(p) if ("q_norm" in name or "k_norm" in name) else
                    1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.2 * torch.rand_like(b))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**CONFIG)).float().eval()
    _randomize(model)
    d = tmp_path_factory.mktemp("gemma4_text")
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = "eager"
    return model, d


def test_config_reads_gemma4_text(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.head_dim, cfg.global_head_dim, cfg.kv_heads, cfg.global_kv_heads, cfg.k_eq_v) == (
        "gemma4_text", 16, 32, 2, 2, True)
    assert (cfg.v_norm, cfg.layer_scalar, cfg.qk_norm, cfg.norm_offset, cfg.query_pre_attn_scalar) == (
        True, True, True, 0.0, 1.0)
    assert (cfg.sliding_window, cfg.layer_types[:2], cfg.final_softcap, cfg.local_rope_theta) == (
        4, ("sliding_attention", "full_attention"), 30.0, 10000.0)
    assert cfg.rope_scaling == fpp.ops.ProportionalScaling(0.25) and cfg.rope_theta == 1e6
    decls = dict(tree.leaves_with_paths(llama.init(cfg)))
    assert "layers.1.self_attn.v_proj" not in decls and decls["layers.0.self_attn.v_proj"].shape == (64, 2, 16)
    assert decls["layers.1.self_attn.q_proj"].shape == (64, 4, 32) and decls["layers.1.layer_scalar"].shape == ()


def test_import_logits_equal_transformers(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved)
    # each Gemma 4 option changes the result (so the equality above covers it)
    for change in (dict(v_norm=False), dict(rope_scaling=None), dict(local_rope_theta=None), dict(final_softcap=None),
                   dict(query_pre_attn_scalar=None)):
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change
    ones = tree.tree_map(lambda t: t, params)            # (a new tree: the layer scalars at 1)
    for layer in ones["layers"]:
        layer["layer_scalar"] = torch.ones(())
    assert not torch.allclose(our_logits(ones, cfg, toks), want, atol=1e-3)


def test_loss_and_gradients_equal_transformers(saved):
    _, d = saved
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    assert torch.equal(ours["layers.0.layer_scalar"], torch.zeros((), dtype=torch.float64))     # a constant of the files
    for name, p in model.named_parameters():
        path = hf.our_path(name)
        got = hf.KINDS[hf.hf_kind(path, "gemma4_text")].to_hf(ours[path])
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6 * p.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "gemma4_text", "Gemma4ForCausalLM", **EAGER)


@pytest.mark.parametrize("layout", ["fsdp_tp_sp", "cp"])
def test_layouts_equal_one_device(saved, layout):
    """FSDP x TP with sequence parallelism (heads of both widths, the k/v heads of the full
    layers and the vocabulary over tp, hidden over dp_shard) and CP (the windows over the
    load-balanced split sequence)."""
    assert_hf_layout_equals_one_device(saved[1], layout)


def test_fsdp_tp_on_real_processes_equal_one_device(saved):
    """Two AdamW steps with FSDP x TP on four real gloo processes equal one device (the layer
    scalars stay as loaded)."""
    from harness import assert_processes_equal_one_device
    opt = fpp.optim.adamw(3e-3, weight_decay=0.1, clip_norm=1.0, mask=fpp.optim.decay_mask_by_ndim)   # (the trainer's)
    one = assert_processes_equal_one_device(hf.config_from_hf(saved[1]), opt=opt)
    assert float(one[1]["layers.0.layer_scalar"]) == 1.0 and float(one[1]["layers.0.input_layernorm"][0]) != 1.0


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A tiny ``Gemma4ForConditionalGeneration`` (a one-layer vision tower beside the text decoder)."""
    torch.manual_seed(1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    special = dict(image_token_id=300, boi_token_id=301, eoi_token_id=302, video_token_id=303)   # (past the vocabulary)
    conf = transformers.Gemma4Config(text_config=dict(CONFIG, pad_token_id=0), vision_config=vision, audio_config=None,
                                     boa_token_id=None, eoa_token_index=None, audio_token_id=None, **special)
    model = transformers.Gemma4ForConditionalGeneration(conf).float().eval()
    _randomize(model)
    d = tmp_path_factory.mktemp("gemma4")
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = "eager"
    model.config.text_config._attn_implementation = "eager"
    return model, d


def test_multimodal_checkpoint_loads_its_text_decoder(multimodal, tmp_path):
    """``model_type: gemma4``: the text decoder under ``model.language_model.`` loads (the vision
    tower's tensors left aside) with transformers' logits of text-only input; export writes that
    decoder as ``Gemma4ForCausalLM`` with the same logits."""
    model, d = multimodal
    cfg, params = hf.load_hf_llama(d)
    assert cfg.model_type == "gemma4" and cfg.global_head_dim == 32
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
    out = hf.save_hf_llama(params, cfg, tmp_path / "text")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma4ForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **EAGER)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=toks).logits, want, atol=1e-5, rtol=1e-5)


def test_refusals_name_the_option(saved, tmp_path):
    conf = json.loads((saved[1] / "config.json").read_text())
    for key, value, what in (("num_kv_shared_layers", 4, "must be fewer than num_hidden_layers"),
                             ("use_bidirectional_attention", "all", "causal attention only"),
                             ("attention_dropout", 0.1, "set it to 0.0")):
        with pytest.raises(ck.CheckpointMismatchError, match=rf"HF gemma4_text config: {key}=.*{what}"):
            hf.config_from_hf(dict(conf, **{key: value}))
    with pytest.raises(ck.CheckpointMismatchError, match=r"per_layer_config names layers \[0, 1, 3\]"):
        hf.config_from_hf(dict(conf, per_layer_config={str(i): {"head_dim": 32} for i in (0, 1, 3)}))
    cfg = hf.config_from_hf(saved[1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'gemma4_text': norm_offset=1.0 has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, norm_offset=1.0), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'gemma3_text': global_head_dim=32 has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="gemma3_text"), tmp_path / "no")
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match=r"global_kv_heads=3 must divide heads=4"):
        dataclasses.replace(cfg, global_kv_heads=3)
