"""Gemma 4 unified (``gemma4_unified``, Gemma 4 12B: no vision encoder, models/gemma4_unified.py's
embedder; an image's tokens attending to each other, ops.attention's ``groups``) equals transformers'
``Gemma4UnifiedForConditionalGeneration`` on a tiny random checkpoint with rows of 0, 1 and 2 images:
logits, fp64 loss and every gradient; LoRA with Axolotl's regex equals peft's; FSDP, TP and CP (packed
rows too) on simulated devices and DP x FSDP on real gloo processes equal one device; export writes
the unified class, which transformers loads with our logits."""
import dataclasses
import json

import pytest
import torch
from harness import single_device
from vision_harness import (assert_export_equals_hf, assert_layout_equals_one_device, assert_logits_equal_hf,
                            assert_lora_equals_peft, assert_loss_and_grads_equal_hf, assert_processes_equal_one_device,
                            pooled_case, saved_config)

from functional_pp.checkpoint import hf
from functional_pp.models import gemma4_hf, gemma4_unified_hf, llama_hf

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4UnifiedForConditionalGeneration"):
    pytest.skip("transformers without Gemma 4 unified", allow_module_level=True)

IMAGE, BOI, EOI = 250, 251, 252
TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=4, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=None,
            eos_token_id=None, max_position_embeddings=128)
VISION = dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=16, mm_posemb_size=8, output_proj_dims=16)
P, K = 4, 2                                                    # patch side, pooling kernel


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    conf = transformers.Gemma4UnifiedConfig(text_config=TEXT, vision_config=VISION, audio_config=None,
                                            image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI,
                                            video_token_id=253, audio_token_id=254, boa_token_id=255,
                                            eoa_token_index=249)
    model = transformers.Gemma4UnifiedForConditionalGeneration(conf).float().eval()
    with torch.no_grad():                       # O(1) logits; norms and position tables off their initial values
        for n, p in model.named_parameters():
            if "q_norm" in n or "k_norm" in n:
                p.copy_(0.4 + 0.05 * torch.randn_like(p))
            elif "norm" in n or "_ln" in n:
                p.copy_((0 if n.endswith("bias") else 1) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(0.6 + 0.2 * torch.rand_like(b))
    d = tmp_path_factory.mktemp("gemma4_unified")
    return model, d, saved_config(model, d)


# (transformers takes model patches of K x P pixels; row 0's first image, 6 tokens, is longer than the window)
CASE = pooled_case("Gemma4UnifiedForConditionalGeneration", (IMAGE, BOI, EOI), P, K, K * P, groups=True)
rows, hf_inputs, entries = CASE.rows, CASE.hf_inputs, CASE.entries


def test_config_reads_the_embedder_and_the_bidirectional_mask(saved):
    _, _, cfg = saved
    v = cfg.vision
    assert (cfg.model_type, v.tower, v.patch_size, v.pool, v.embed, v.positions) == (
        "gemma4_unified", "gemma4_unified", 4, 2, 16, 8)
    assert (v.image_token_id, v.boi_token_id, v.eoi_token_id) == (IMAGE, BOI, EOI)
    assert cfg.image_groups_attend and cfg.per_layer_input == 0 and cfg.sliding_window == 4


def test_logits_equal_transformers(saved):
    _, _, cfg = saved
    params, (ids, pixels), want = assert_logits_equal_hf(CASE, *saved, atol=5e-5)
    causal = CASE.logits(params, dataclasses.replace(cfg, image_groups_attend=False), ids, pixels)
    assert (causal - want).abs().max() > 1e-2            # the image tokens' bidirectional attention matters


def test_loss_and_every_gradient_equal_transformers(saved):
    _, d, cfg = saved
    # (transformers' RMSNorms run in float32 whatever the dtype: float32's precision; the layer scalars are
    # constants of the files: no gradient, ours zero; transformers' modules named after its load-time renames)
    names = assert_loss_and_grads_equal_hf(CASE, d, cfg, loss_rtol=1e-6, constants=("layer_scalar",),
                                           module=lambda name, path: llama_hf.module_renamed(path, cfg.model_type, cfg))
    assert {"model.vision_embedder.patch_dense.bias", "model.vision_embedder.pos_embedding",
            "model.embed_vision.embedding_projection.weight"} <= names           # (the files' names)


AXOLOTL_TARGETS = (r"model.language_model.layers.[\d]+.(_checkpoint_wrapped_module.)?(mlp|self_attn)."
                   r"(up|down|gate|q|k|v|o)_proj")
"""The example's lora_target_modules (gemma4-unified/12b-vision-lora.yaml): the text decoder's linears."""


def test_lora_with_the_examples_regex_equals_peft(saved):
    """LoRA with the example's regex, a batch with images: the loss and every adapter gradient of one
    step equal peft's on transformers' unified model (float64)."""
    _, d, cfg = saved
    # (float32's precision where transformers' RMSNorms run in float32)
    assert_lora_equals_peft(CASE, d, cfg, AXOLOTL_TARGETS, seed=5, rows_seed=6, count=2 * 7 * cfg.layers,
                            loss_rtol=1e-6)


def _with_documents(batch):
    """The batch as packed rows: each row two documents (split at token 9: row 0's second image and
    row 3's image in the second), ``segments`` their ids."""
    seg = torch.zeros_like(batch["tokens"])
    seg[:, 9:] = 1
    return {**batch, "segments": seg}


@pytest.mark.parametrize("layout", ["fsdp", "tp", "cp", "cp_packed"])
def test_layouts_equal_one_device(saved, layout):
    _, d, cfg = saved
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    batch = CASE.batch(*rows(seed=2, seq=17, dtype=torch.float64), cfg)   # (16 tokens: load-balanced over cp 2)
    if layout == "cp_packed":            # (the documents cut an image's group from the text before it)
        batch = _with_documents(batch)
        causal = single_device(dataclasses.replace(cfg, image_groups_attend=False), params, batch)[0]
        assert (causal - single_device(cfg, params, batch)[0]).abs() > 1e-4
    assert_layout_equals_one_device(cfg, params, batch, layout.removesuffix("_packed"))


def test_export_writes_the_unified_class(saved, tmp_path):
    """Parameters moved off the checkpoint's values, exported: ``Gemma4UnifiedForConditionalGeneration``'s
    config, reading back as ours; the checkpoint's tensor names; transformers loads them with our
    logits on rows with images (float64)."""
    raw = assert_export_equals_hf(CASE, saved[1], saved[2], tmp_path / "out", "gemma4_unified")
    assert raw["text_config"]["use_bidirectional_attention"] == "vision"


def test_bad_inputs_are_refused_by_name(saved):
    _, d, cfg = saved
    raw = json.loads((d / "config.json").read_text())
    with pytest.raises(ValueError, match="use_bidirectional_attention='all' is not supported"):
        gemma4_hf.config_from_hf({**raw, "text_config": {**raw["text_config"], "use_bidirectional_attention": "all"}},
                                 "gemma4_unified")
    with pytest.raises(ValueError, match="output_proj_dims=8 differs from mm_embed_dim=16"):
        gemma4_unified_hf.vision_from_hf({**raw, "vision_config": {**raw["vision_config"], "output_proj_dims": 8}})
    batch = {k: v for k, v in CASE.batch(*rows(), cfg).items() if k != "image_groups"}
    with pytest.raises(ValueError, match="image_groups_attend .* needs the batch's image_groups"):
        single_device(cfg, hf.load_hf_params(d, cfg, dtype=torch.float64), batch)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    """Two AdamW steps with images on DP x FSDP over four gloo processes equal one device."""
    params = assert_processes_equal_one_device(CASE, saved[2])
    assert any(p.startswith("multi_modal_projector.patch_dense") for p in params)
