"""InternVL (models/internvl.py: the InternViT tower, CLIP's layers with layer scales; the pixel-shuffle
projector of models/lfm2_vl.py; a Qwen decoder) equals transformers' ``InternVLForConditionalGeneration``
on a tiny random checkpoint: logits, fp64 loss and every gradient, LoRA on the decoder equal to
peft's; FSDP and TP on two simulated devices and DP x FSDP on real gloo processes equal one device;
export writes the multimodal class, which transformers loads with our logits; bad inputs are refused
by name."""
import dataclasses

import pytest
import torch
from vision_harness import (ImageRows, assert_export_equals_hf, assert_logits_equal_hf, assert_lora_equals_peft,
                            assert_loss_and_grads_equal_hf, assert_processes_equal_one_device,
                            assert_rows_layout_equals_one_device, renaming, saved_config)

from functional_pp.checkpoint import hf
from functional_pp.data.images import image_batch
from functional_pp.models import internvl_hf

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "InternVLForConditionalGeneration"):
    pytest.skip("transformers without InternVL", allow_module_level=True)

IMAGE = 400
TEXT = dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=512, initializer_range=0.2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
              patch_size=4, attention_bias=True, initializer_range=0.2)
TILES = [2, 1, 0, 1]                  # per row: its tiles of 16 x 16 pixels (4 x 4 patches: 4 image tokens each)


def build(d, **kw):
    torch.manual_seed(0)
    conf = transformers.InternVLConfig(text_config=TEXT, vision_config=dict(VISION, **kw.pop("vision", {})),
                                       image_token_id=IMAGE, **kw)
    model = transformers.InternVLForConditionalGeneration(conf).eval()
    with torch.no_grad():                       # the norms, biases, scales and the zero-initialised tables moved
        for n, p in model.named_parameters():
            if p.ndim == 1 or "embeddings." in n:
                p.add_(0.3 * torch.randn_like(p))
    return model, saved_config(model, d)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("internvl")
    model, cfg = build(d)
    return model, d, cfg


def rows(seed=0, seq=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (len(TILES), seq), generator=g)
    ids[0, 1:9], ids[1, 4:8], ids[3, 10:14] = IMAGE, IMAGE, IMAGE
    pixels = [torch.randn(n, 3, 16, 16, generator=g, dtype=dtype) if n else None for n in TILES]
    return ids, pixels


def hf_inputs(ids, pixels):
    return dict(input_ids=ids, pixel_values=torch.cat([p for p in pixels if p is not None]))


def entries(ids, pixels, cfg=None):
    return image_batch(ids, pixels, [torch.tensor([[16, 16]] * n) if n else None for n in TILES], patch=4, merge=2,
                       image_token_id=IMAGE, class_token="dropped", image_size=16)


CASE = ImageRows("InternVLForConditionalGeneration", IMAGE, rows, hf_inputs, entries)


def test_logits_equal_transformers(saved):
    cfg = saved[2]
    assert (cfg.model_type, cfg.text_of, cfg.vision.tower, cfg.vision.merge) == ("qwen3", "internvl", "internvit", 2)
    assert_logits_equal_hf(CASE, *saved, atol=1e-5)


def test_an_earlier_layers_features_and_the_final_norm_equal_transformers(tmp_path):
    """``vision_feature_layer: -2`` (the layers after it not run, not declared) and ``use_mean_pooling: false``
    (a LayerNorm on the last hidden states, here unread)."""
    model, cfg = build(tmp_path, vision_feature_layer=-2, vision=dict(use_mean_pooling=False))
    assert cfg.vision.used_layers == 1 and cfg.vision.final_norm
    ids, pixels = rows(seed=3)
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
    torch.testing.assert_close(CASE.logits(hf.load_hf_params(tmp_path, cfg), cfg, ids, pixels), want, atol=1e-5,
                               rtol=1e-5)


def test_loss_and_every_gradient_equal_transformers(saved):
    _, d, cfg = saved
    # (transformers' rotary tables are float32 whatever the dtype: float32's precision, not float64's)
    module = renaming(("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                      ("multi_modal_projector.", "model.multi_modal_projector."),
                      ("language_model.lm_head.", "lm_head."))
    names = assert_loss_and_grads_equal_hf(CASE, d, cfg, rtol=1e-5, scale=1e-6, module=module)
    assert "vision_tower.embeddings.cls_token" in names


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_fsdp_and_tp_equal_one_device(saved, layout):
    assert_rows_layout_equals_one_device(CASE, saved[1], saved[2], layout)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    """Two AdamW steps with images on DP x FSDP over four gloo processes equal one device (a one-layer tower)."""
    cfg = saved[2]
    small = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, layers=1))
    assert any(p.startswith("vision_tower.encoder.") for p in assert_processes_equal_one_device(CASE, small))


def test_lora_on_axolotls_targets_equals_peft(saved):
    """The example config's ``lora_target_modules`` regex (the decoder's attention and MLP projections) on
    rows with images: our loss and every adapter gradient of one step equal peft's."""
    _, d, cfg = saved
    regex = r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"
    assert_lora_equals_peft(CASE, d, cfg, regex, seed=3, rows_seed=5, count=2 * 2 * 7, rtol=1e-5, scale=1e-6)


def test_export_writes_the_multimodal_class(saved, tmp_path):
    _, d, cfg = saved
    assert_export_equals_hf(CASE, d, cfg, tmp_path / "out", "internvl")     # (atol: transformers' float32 rotary)


def test_bad_inputs_are_refused_by_name(saved):
    ids, pixels = rows()
    ids[0, 8] = 5                                   # one image token too few in row 0
    with pytest.raises(ValueError, match=r"row 0 holds 7 image tokens \(id 400\) but its 2 images make 8"):
        entries(ids, pixels)
    with pytest.raises(ValueError, match="an image of 8 x 16 pixels; a CLIP tower takes 16 x 16"):
        image_batch(ids[:1], [torch.zeros(1, 3, 16, 16)], [torch.tensor([[8, 16]])], patch=4, merge=2,
                    image_token_id=IMAGE, class_token="dropped", image_size=16)
    for key, value in (("use_qk_norm", True), ("norm_type", "rms_norm")):
        with pytest.raises(ValueError, match=f"vision_config.{key}={value!r} is not supported"):
            internvl_hf.vision_from_hf({"model_type": "internvl", "vision_config": dict(VISION, **{key: value})})
    with pytest.raises(ValueError, match="image_size=18 must be patch_size=4 times a multiple of"):
        internvl_hf.vision_from_hf({"model_type": "internvl", "vision_config": dict(VISION, image_size=18)})
