"""Gemma 4's vision-language model (models/gemma4_vision.py: the vision encoder, the pooler and the
multimodal embedder; data/images.py's entries in pooling order) equals transformers'
``Gemma4ForConditionalGeneration`` on a tiny random checkpoint: logits, fp64 loss and every
gradient; LoRA on the text decoder equals peft's; FSDP and TP on two simulated devices and DP x FSDP
on real gloo processes equal one device; bad inputs are refused by name; export writes the
multimodal class, which transformers loads with our logits."""
import dataclasses
import json

import pytest
import torch
from harness import single_device
from vision_harness import (assert_export_equals_hf, assert_logits_equal_hf, assert_lora_equals_peft,
                            assert_loss_and_grads_equal_hf, assert_processes_equal_one_device,
                            assert_rows_layout_equals_one_device, pooled_case, saved_config)

from functional_pp.checkpoint import hf
from functional_pp.models import gemma4_vision_hf

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
    pytest.skip("transformers without Gemma 4", allow_module_level=True)

IMAGE, BOI, EOI = 250, 251, 252
TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=4, hidden_size_per_layer_input=0,
            final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
            bos_token_id=None, eos_token_id=None, max_position_embeddings=128)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=8)
P, K = 4, 2                                                    # patch side, pooling kernel


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    conf = transformers.Gemma4Config(text_config=TEXT, vision_config=VISION, audio_config=None, image_token_id=IMAGE,
                                     boi_token_id=BOI, eoi_token_id=EOI, video_token_id=253, audio_token_id=254,
                                     boa_token_id=255, eoa_token_index=249)
    model = transformers.Gemma4ForConditionalGeneration(conf).float().eval()
    with torch.no_grad():                       # O(1) logits; norms and position tables off their initial values
        for n, p in model.named_parameters():
            if "q_norm" in n or "k_norm" in n:
                p.copy_(0.4 + 0.05 * torch.randn_like(p))
            elif "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(0.6 + 0.2 * torch.rand_like(b))
    d = tmp_path_factory.mktemp("gemma4_vl")
    return model, d, saved_config(model, d)


CASE = pooled_case("Gemma4ForConditionalGeneration", (IMAGE, BOI, EOI), P, K, P)
rows, hf_inputs, entries = CASE.rows, CASE.hf_inputs, CASE.entries


def test_config_reads_the_tower(saved):
    _, _, cfg = saved
    v = cfg.vision
    assert (cfg.model_type, v.tower, v.layers, v.hidden, v.heads, v.head_dim, v.pool, v.positions) == (
        "gemma4", "gemma4", 2, 16, 2, 8, 2, 8)
    assert (v.image_token_id, v.boi_token_id, v.eoi_token_id) == (IMAGE, BOI, EOI)


def test_logits_equal_transformers(saved):
    assert_logits_equal_hf(CASE, *saved, atol=5e-5)


def test_loss_and_every_gradient_equal_transformers(saved):
    # (transformers' vision rotary and pooler run in float32 whatever the dtype: float32's precision; the
    # layer scalars are constants of the files: no gradient, ours zero)
    names = assert_loss_and_grads_equal_hf(CASE, saved[1], saved[2], loss_rtol=1e-6, constants=("layer_scalar",))
    assert {"model.vision_tower.encoder.layers.1.self_attn.q_proj.linear.weight",
            "model.embed_vision.embedding_projection.weight"} <= names


AXOLOTL_TARGETS = (r"model.language_model.layers.[\d]+.(_checkpoint_wrapped_module.)?(mlp|self_attn)."
                   r"(up|down|gate|q|k|v|o)_proj")
"""The example's lora_target_modules (gemma4-unified/12b-vision-lora.yaml): the text decoder's linears."""


def test_lora_on_the_text_decoder_equals_peft(saved):
    """LoRA with the example's regex on the text decoder, a batch with images: the loss and every
    adapter gradient of one step equal peft's on transformers' multimodal model (float64)."""
    _, d, cfg = saved
    # (float32's precision where transformers' vision rotary and pooler run in float32)
    run = assert_lora_equals_peft(CASE, d, cfg, AXOLOTL_TARGETS, seed=5, rows_seed=6, count=2 * 7 * cfg.layers,
                                  loss_rtol=1e-6)
    assert not any("vision" in k for k in run.grads)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_fsdp_and_tp_equal_one_device(saved, layout):
    assert_rows_layout_equals_one_device(CASE, saved[1], saved[2], layout)


def test_export_writes_the_multimodal_class(saved, tmp_path):
    """Parameters moved off the checkpoint's values, exported: ``Gemma4ForConditionalGeneration``'s
    config, reading back as ours; the checkpoint's tensor names; transformers loads them with our
    logits on rows with images (float64)."""
    assert_export_equals_hf(CASE, saved[1], saved[2], tmp_path / "out", "gemma4")


def test_bad_inputs_are_refused_by_name(saved):
    _, d, cfg = saved
    ids, pixels = rows()
    ids[0, 11] = 5                                  # one image token too few in row 0
    with pytest.raises(ValueError, match=r"row 0 holds 6 image tokens \(id 250\) but its 2 images make 7"):
        entries(ids, pixels)
    raw = json.loads((d / "config.json").read_text())
    for key, value, match in (("use_clipped_linears", True, "vision_config.use_clipped_linears=True is not supported"),
                              ("standardize", True, "vision_config.standardize=True is not supported"),
                              ("num_key_value_heads", 1, "vision_config.num_key_value_heads=1 is not supported"),
                              ("hidden_activation", "silu", "hidden_activation='silu' is not supported")):
        with pytest.raises(ValueError, match=match):
            gemma4_vision_hf.vision_from_hf({**raw, "vision_config": {**raw["vision_config"], key: value}})
    with pytest.raises(ValueError, match=r"hidden_size_per_layer_input \(with images\)=256 is not supported"):
        gemma4_vision_hf.vision_from_hf({**raw, "text_config": {**raw["text_config"],
                                                                 "hidden_size_per_layer_input": 256}})
    with pytest.raises(ValueError, match="not a multiple of pooling_kernel_size² = 4"):
        batch = CASE.batch(*rows(), cfg)
        batch = {k: v[:, :-1] if k.startswith("patch") else v for k, v in batch.items()}
        single_device(cfg, hf.load_hf_params(d, cfg, dtype=torch.float64), batch)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    """Two AdamW steps with images on DP x FSDP over four gloo processes equal one device."""
    cfg = saved[2]
    small = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, layers=1))
    assert any(p.startswith("vision_tower.encoder.") for p in assert_processes_equal_one_device(CASE, small))
