"""PaddleOCR-VL (``PaddleOCRVLForConditionalGeneration``): its ERNIE-4.5 decoder with the rotate-half
multimodal rotary, its NaViT SigLIP tower (models/qwen_vision.py's ``paddleocr_vl``: one frame per
patch, a LayerNorm after the last block, the position table resampled at half-pixel centres) and
its projector equal transformers on a tiny random checkpoint: the 3D positions, logits, fp64 loss
and every gradient; LoRA on the decoder equals peft's; FSDP and TP on two simulated devices and DP x
FSDP on real gloo processes equal one device; export writes the multimodal class, which transformers
loads with our logits."""
import dataclasses
import json

import pytest
import torch
from vision_harness import (GRIDS, assert_export_equals_hf, assert_lora_equals_peft, assert_loss_and_grads_equal_hf,
                            assert_processes_equal_one_device, assert_rows_layout_equals_one_device, config_of,
                            grid_case, renaming, saved_config)

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.checkpoint.format import CheckpointMismatchError
from functional_pp.data.images import IMAGE_DIMS
from functional_pp.data.qwen_images import qwen_image_batch
from functional_pp.models import llama, paddleocr_vl_hf
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "PaddleOCRVLForConditionalGeneration"):
    pytest.skip("transformers without PaddleOCR-VL", allow_module_level=True)

IMAGE = 250
TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, use_bias=True, pad_token_id=None, bos_token_id=None,
            eos_token_id=None, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]))
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
              spatial_merge_size=2, image_size=12)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    conf = transformers.PaddleOCRVLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE)
    model = transformers.PaddleOCRVLForConditionalGeneration(conf).float().eval()
    with torch.no_grad():                       # O(1) weights, the norms and biases off their initial values
        for n, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.ndim == 1 or "norm" in n else p.normal_(0, 0.2)
    d = tmp_path_factory.mktemp("paddleocr_vl")
    return model, d, saved_config(model, d)


def entries(ids, pixels, cfg):
    v = cfg.vision
    return qwen_image_batch(ids, [None if p is None else p.reshape(len(p), -1) for p in pixels],
                            [torch.tensor(gr) if gr else None for gr in GRIDS], merge=v.merge, image_token_id=IMAGE,
                            side=v.side, channels=v.channels, temporal_patch=v.temporal_patch, patch=v.patch_size,
                            resample=v.resample, raster=True)


CASE = grid_case("PaddleOCRVLForConditionalGeneration", IMAGE, (3, 4, 4), entries)
rows, hf_inputs = CASE.rows, CASE.hf_inputs
MODULES = renaming(("model.", "model.language_model."), ("visual.", "model.visual."), ("mlp_AR.", "model.projector."))
"""The files' names -> transformers 5's modules'."""


def test_config_and_positions(saved):
    model, _, cfg = saved
    assert (cfg.model_type, cfg.text_of, cfg.mrope_section, cfg.mrope_interleaved, cfg.rotary_interleaved,
            cfg.o_bias, cfg.mlp_bias) == ("ernie4_5", "paddleocr_vl", (2, 1, 1), False, False, True, True)
    v = cfg.vision
    assert (v.tower, v.temporal_patch, v.side, v.post_norm, v.merger_eps, v.align_corners) == (
        "paddleocr_vl", 1, 3, True, 1e-5, False)
    # the hub's flat config.json (the decoder's keys at the top, rope_scaling and rope_theta) reads alike
    raw = json.loads((saved[1] / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **raw, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "default", "mrope_section": rope["mrope_section"]}}
    assert config_of(flat) == cfg
    ids, pixels = rows()
    inputs = hf_inputs(ids, pixels)
    want, _ = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    torch.testing.assert_close(entries(ids, pixels, cfg)["mrope_positions"].permute(2, 0, 1), want, rtol=0, atol=0)


def test_logits_equal_transformers(saved):
    model, d, cfg = saved
    params = hf.load_hf_params(d, cfg)
    ids, pixels = rows()
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
        named = sharding.named_tree(params, llama.init(cfg))
        images = {k: fpp.wrap(v, IMAGE_DIMS[k]) for k, v in entries(ids, pixels, cfg).items()}
        got = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg, images=images).value()
        text_only = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg).value()
        # the pixels in merge order as they come (not put back from raster order): other features
        unordered = {**images, "patches": fpp.wrap(qwen_image_batch(
            ids, [None if p is None else p.reshape(len(p), -1) for p in pixels],
            [torch.tensor(gr) if gr else None for gr in GRIDS], merge=2, image_token_id=IMAGE, side=3, channels=3,
            temporal_patch=1, patch=4, resample="bilinear_half")["patches"], IMAGE_DIMS["patches"])}
        shuffled = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg, images=unordered).value()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert (text_only - want).abs().max() > 0.1 and (shuffled - want).abs().max() > 1e-3
    torch.testing.assert_close(text_only[2], want[2], atol=2e-5, rtol=1e-5)     # (row 2: no image)


def test_loss_and_every_gradient_equal_transformers(saved):
    # (transformers' vision rotary and its interpolation weights are float32 whatever the dtype)
    names = assert_loss_and_grads_equal_hf(CASE, saved[1], saved[2], module=MODULES)
    assert "visual.vision_model.post_layernorm.weight" in names


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_fsdp_and_tp_equal_one_device(saved, layout):
    assert_rows_layout_equals_one_device(CASE, saved[1], saved[2], layout)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    cfg = saved[2]
    small = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, layers=1))
    assert "vision_tower.post_norm" in assert_processes_equal_one_device(CASE, small)


def test_lora_on_the_decoder_equals_peft(saved):
    """LoRA on the decoder's attention and MLP projections (transformers 5's module names, as Axolotl's
    examples write them for a multimodal model) on rows with images: our loss and every adapter
    gradient of one step equal peft's (its adapters' names: transformers 5's modules, here mapped to
    the files')."""
    _, d, cfg = saved
    regex = r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"
    peft = assert_lora_equals_peft(CASE, d, cfg, regex, seed=3, rows_seed=5, count=2 * 2 * 7,
                                   peft_name=lambda k: k.replace("model.language_model.", "model.", 1))
    assert all(k.startswith("base_model.model.model.layers.") for k in peft.grads)


def test_export_writes_the_multimodal_class(saved, tmp_path):
    assert_export_equals_hf(CASE, saved[1], saved[2], tmp_path / "out", "paddleocr_vl")


def test_bad_config_refused_by_name():
    with pytest.raises(ValueError, match=r"vision_config.layer_norm_eps=1e-05 is not supported"):
        paddleocr_vl_hf.vision_from_hf({"model_type": "paddleocr_vl", "vision_config": dict(VISION, layer_norm_eps=1e-5)})


def test_text_alone_loads_and_its_export_is_refused_by_name(saved, tmp_path):
    """The decoder alone (no processor_type: the tower and projector left aside) = transformers' text
    logits; exporting it alone is refused naming the rotary (Ernie4_5ForCausalLM rotates pairs)."""
    model, d, _ = saved
    cfg, params = hf.load_hf_llama(d, dtype=torch.float64)
    assert cfg.vision is None and cfg.text_of == "paddleocr_vl"
    ids, _ = rows()
    model = transformers.PaddleOCRVLForConditionalGeneration.from_pretrained(d, dtype=torch.float64).eval()
    with torch.no_grad():
        got = llama.forward(sharding.named_tree(params, llama.init(cfg, torch.float64)), fpp.wrap(ids, "batch seq"),
                            cfg).value()
        # (transformers' text rotary tables are float32 whatever the dtype)
        torch.testing.assert_close(got, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(CheckpointMismatchError, match="rotary_interleaved=False has no Ernie4_5ForCausalLM equivalent"):
        hf.save_hf_llama(params, cfg, tmp_path / "text")
