"""Qwen3.5's vision-language model (models/qwen_vision.py: the vision tower and its patch merger;
the multimodal rotary, ops.rotary's ``sections``; data/qwen_images.py's entries) equals
transformers' ``Qwen3_5ForConditionalGeneration`` on a tiny random checkpoint: logits, fp64 loss
and every gradient; FSDP and TP on two simulated devices and DP x FSDP on real gloo processes equal
one device; text positions rotate bitwise as the plain rotary; bad inputs are refused by name; export
writes the multimodal class (Qwen3.5's and Qwen2-VL's), which transformers loads with our logits."""
import dataclasses

import pytest
import torch
from harness import single_device
from vision_harness import (GRIDS, assert_export_equals_hf, assert_logits_equal_hf, assert_loss_and_grads_equal_hf,
                            assert_processes_equal_one_device, assert_rows_layout_equals_one_device, grid_case,
                            renaming, saved_config)

import functional_pp as fpp
from functional_pp import ops
from functional_pp.checkpoint import hf
from functional_pp.data.qwen_images import mrope_positions, qwen_image_batch
from functional_pp.models import qwen_vision_hf

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
    pytest.skip("transformers without Qwen3.5", allow_module_level=True)

IMAGE = 250
TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"], initializer_range=0.2, pad_token_id=None,
            bos_token_id=None, eos_token_id=None, max_position_embeddings=128,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))
VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=9, initializer_range=0.2)
PATCH = 3 * 2 * 4 * 4                                              # channels x temporal x patch x patch


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    conf = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                                      video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    model = transformers.Qwen3_5ForConditionalGeneration(conf).float().eval()
    with torch.no_grad():                       # the norms and biases off their initial values
        for n, p in model.named_parameters():
            if p.ndim == 1 or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("qwen3_5_vl")
    return model, d, saved_config(model, d)


def entries(ids, pixels, cfg):
    v = cfg.vision
    return qwen_image_batch(ids, pixels, [torch.tensor(gr) if gr else None for gr in GRIDS], merge=v.merge,
                            image_token_id=IMAGE, side=v.side, channels=v.channels, temporal_patch=v.temporal_patch,
                            patch=v.patch_size)


CASE = grid_case("Qwen3_5ForConditionalGeneration", IMAGE, (PATCH,), entries)
rows, hf_inputs = CASE.rows, CASE.hf_inputs
QWEN2_VL = dataclasses.replace(CASE, hf_class="Qwen2VLForConditionalGeneration")


def test_config_reads_the_tower_and_the_multimodal_rotary(saved):
    _, _, cfg = saved
    assert (cfg.model_type, cfg.mrope_section, cfg.mrope_interleaved) == ("qwen3_5", (2, 1, 1), True)
    v = cfg.vision
    assert (v.tower, v.layers, v.hidden, v.heads, v.temporal_patch, v.side) == ("qwen3_vl", 2, 16, 2, 2, 3)


def test_positions_equal_transformers_rope_index(saved):
    model, _, cfg = saved
    ids, _ = rows()
    inputs = hf_inputs(ids, rows()[1])
    want, _ = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    got = entries(ids, rows()[1], cfg)["mrope_positions"]
    torch.testing.assert_close(got.permute(2, 0, 1), want, rtol=0, atol=0)
    assert (got[2, :, 0] == got[2, :, 1]).all() and (got[0, 2:8, 1] != got[0, 2:8, 2]).any()


def test_logits_equal_transformers(saved):
    # (float32 rounding through the tower: 3e-5 at most on logits up to 5; the float64 loss agrees to 1e-8)
    assert_logits_equal_hf(CASE, *saved, atol=5e-5)


def test_equal_positions_rotate_bitwise_as_the_plain_rotary():
    g = torch.Generator().manual_seed(0)
    x = fpp.wrap(torch.randn(2, 5, 3, 8, generator=g), "batch seq heads head_dim")
    pos = ops.positions("seq", 5)
    three = fpp.wrap(torch.arange(5)[:, None, None].expand(5, 2, 3).clone(), "seq batch mrope")
    plain = ops.rotary(x, pos, head_dim="head_dim").value()
    for interleaved in (False, True):
        sections = ops.mrope_sections((2, 1, 1), interleaved, 4)
        got = ops.rotary(x, three, head_dim="head_dim", sections=sections).value()
        assert torch.equal(got, plain)
    assert ops.mrope_sections((11, 11, 10), True, 32)[:6] == (0, 1, 2, 0, 1, 2)
    assert ops.mrope_sections((2, 1, 1), False, 4) == (0, 0, 1, 2)


def test_loss_and_every_gradient_equal_transformers(saved):
    # (transformers' vision rotary runs in float32 whatever the dtype: float32's precision, not float64's)
    names = assert_loss_and_grads_equal_hf(CASE, saved[1], saved[2])
    assert "model.visual.blocks.1.attn.qkv.weight" in names


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_fsdp_and_tp_equal_one_device(saved, layout):
    assert_rows_layout_equals_one_device(CASE, saved[1], saved[2], layout)


def test_bad_inputs_are_refused_by_name(saved):
    _, _, cfg = saved
    ids, pixels = rows()
    ids[0, 10] = 5                                  # one image token too few in row 0
    with pytest.raises(ValueError, match=r"row 0 holds 6 image tokens \(id 250\) but its 2 images make 7"):
        entries(ids, pixels, cfg)
    with pytest.raises(ValueError, match="image token at position 3 past the row's 0 images"):
        mrope_positions(torch.tensor([1, 2, 3, IMAGE]), None, IMAGE, 2)
    with pytest.raises(ValueError, match="deepstack_visual_indexes=\\[1\\] is not supported"):
        qwen_vision_hf.vision_from_hf({"model_type": "qwen3_5", "text_config": {"hidden_size": 32},
                                       "vision_config": dict(VISION, deepstack_visual_indexes=[1])})
    with pytest.raises(ValueError, match="sections has 3 entries for 4 rotating pairs"):
        x = fpp.wrap(torch.zeros(1, 2, 1, 8), "batch seq heads head_dim")
        ops.rotary(x, fpp.wrap(torch.zeros(2, 1, 3, dtype=torch.long), "seq batch mrope"), head_dim="head_dim",
                   sections=(0, 1, 2))
    with pytest.raises(ValueError, match="needs \\['patch_taps', 'patch_tap_weights'\\] too"):
        batch = CASE.batch(*rows(), cfg)
        del batch["patch_taps"], batch["patch_tap_weights"]
        single_device(cfg, hf.load_hf_params(saved[1], cfg, dtype=torch.float64), batch)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    cfg = saved[2]
    small = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, layers=1))
    # (atol: the key biases' gradient is 0 up to rounding, softmax ignoring a shift common to every key,
    # and Adam's step of that rounding differs by 3e-12 between the layouts)
    params = assert_processes_equal_one_device(CASE, small, atol=1e-10)
    assert any(p.startswith("vision_tower.blocks.") for p in params)


def test_qwen2_vl_equals_transformers(tmp_path):
    """Qwen2-VL (``Qwen2VLForConditionalGeneration``): the same tower without the patch bias and the
    learned positions, a QuickGELU MLP, beside a Qwen2 decoder whose multimodal rotary's sections are
    contiguous: logits, the fp64 loss and every gradient equal transformers'."""
    torch.manual_seed(2)
    text = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                            mrope_section=[1, 2, 1]))
    conf = transformers.Qwen2VLConfig(text_config=text, image_token_id=IMAGE, video_token_id=251,
                                      vision_start_token_id=252, vision_end_token_id=253,
                                      vision_config=dict(depth=2, embed_dim=16, num_heads=2, mlp_ratio=2,
                                                         hidden_size=32, patch_size=4, initializer_range=0.2))
    model = transformers.Qwen2VLForConditionalGeneration(conf).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 1 or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    cfg = saved_config(model, tmp_path)
    assert (cfg.mrope_section, cfg.mrope_interleaved, cfg.vision.tower, cfg.vision.positions) == (
        (1, 2, 1), False, "qwen2_vl", 0)
    ids, pixels = rows(seed=3, dtype=torch.float64)
    assert "patch_taps" not in QWEN2_VL.batch(ids, pixels, cfg)
    inputs = hf_inputs(ids, pixels)
    want_pos, _ = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    torch.testing.assert_close(entries(ids, pixels, cfg)["mrope_positions"].permute(2, 0, 1), want_pos, rtol=0, atol=0)
    # (transformers 5's module names; the files' are these)
    module = renaming(("model.", "model.language_model."), ("visual.", "model.visual."))
    names = assert_loss_and_grads_equal_hf(QWEN2_VL, tmp_path, cfg, seed=3, module=module)
    assert "visual.merger.mlp.0.weight" in names
    # text alone: the checkpoint's decoder loads without its tower (visual.* left aside), transformers' text logits
    text_cfg, text_params = hf.load_hf_llama(tmp_path, dtype=torch.float64)
    assert text_cfg.vision is None and text_cfg.text_of == "qwen2_vl"
    model = QWEN2_VL.hf_model(tmp_path)
    with torch.no_grad():
        # (transformers' text rotary tables are float32 whatever the dtype: 4e-8 apart at most)
        torch.testing.assert_close(QWEN2_VL.logits(text_params, text_cfg, ids), model(input_ids=ids).logits,
                                   rtol=1e-6, atol=1e-6)
    assert_export_equals_hf(QWEN2_VL, tmp_path, cfg, tmp_path / "out", "qwen2_vl")


def test_export_writes_the_multimodal_class(saved, tmp_path):
    """Qwen3.5 with its tower exports as ``Qwen3_5ForConditionalGeneration`` (its text decoder alone
    was written before), which transformers loads with our logits (5e-5: its delta rule and norms run
    in float32 whatever the dtype)."""
    assert_export_equals_hf(CASE, saved[1], saved[2], tmp_path / "out", "qwen3_5")
