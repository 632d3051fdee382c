"""GLM-4V (GLM-4.1V, GLM-4.6V-Flash: ``Glm4vForConditionalGeneration``; models/glm4v_vision.py's
tower beside a GLM-4-0414 decoder whose rotary is the multimodal one, contiguous sections over the
interleaved partial rotary) equals transformers on a tiny random checkpoint: the rotary positions
(``get_rope_index``), the bicubic position taps (``F.grid_sample``), logits, the fp64 loss and every
gradient; FSDP and TP on two simulated devices and DP x FSDP on real gloo processes equal one
device; LoRA equals peft; export writes the multimodal class, which transformers loads with our
logits; bad inputs are refused by name."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from harness import single_device
from vision_harness import (GRIDS, assert_export_equals_hf, assert_logits_equal_hf, assert_lora_equals_peft,
                            assert_loss_and_grads_equal_hf, assert_processes_equal_one_device,
                            assert_rows_layout_equals_one_device, grid_case, saved_config)

from functional_pp.checkpoint import hf
from functional_pp.data.qwen_images import RESAMPLING, qwen_image_batch
from functional_pp.models import glm4v_hf, llama, llama_hf

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Glm4vForConditionalGeneration"):
    pytest.skip("transformers without GLM-4V", allow_module_level=True)

IMAGE = 250
TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=128,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[2, 1, 1]))
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=4,
              image_size=12, temporal_patch_size=2, spatial_merge_size=2, initializer_range=0.2)
PATCH = 3 * 2 * 4 * 4                                              # channels x temporal x patch x patch


def build(tmp, cls=transformers.Glm4vForConditionalGeneration, conf_cls=transformers.Glm4vConfig, seed=0):
    torch.manual_seed(seed)
    conf = conf_cls(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE, video_token_id=251,
                    image_start_token_id=252, image_end_token_id=253)
    model = cls(conf).float().eval()
    with torch.no_grad():                       # the norms and biases off their initial values
        for n, p in model.named_parameters():
            if p.ndim == 1 or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return model, saved_config(model, tmp)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm4v")
    model, cfg = build(d)
    return model, d, cfg


def entries(ids, pixels, cfg):
    v = cfg.vision
    return qwen_image_batch(ids, pixels, [torch.tensor(gr) if gr else None for gr in GRIDS], merge=v.merge,
                            image_token_id=IMAGE, side=v.side, channels=v.channels, temporal_patch=v.temporal_patch,
                            patch=v.patch_size, resample=v.resample)


CASE = grid_case("Glm4vForConditionalGeneration", IMAGE, (PATCH,), entries)
rows, hf_inputs = CASE.rows, CASE.hf_inputs


def test_config_reads_the_decoder_the_rotary_and_the_tower(saved):
    _, _, cfg = saved
    assert (cfg.model_type, cfg.text_of, cfg.mrope_section, cfg.mrope_interleaved) == ("glm4", "glm4v", (2, 1, 1),
                                                                                      False)
    assert (cfg.dim_head, cfg.rotary_dim, cfg.rotary_interleaved, cfg.qkv_bias) == (16, 8, True, True)
    v = cfg.vision
    assert (v.tower, v.layers, v.hidden, v.heads, v.side, v.out_hidden, v.merger_mlp) == ("glm4v", 2, 16, 2, 3, 32, 24)


def test_bicubic_taps_equal_grid_sample():
    """The taps and weights of one axis, times the other's, resample a table as F.grid_sample
    (bicubic, border, align_corners False) does at the patch centres of grids smaller and larger."""
    g = torch.Generator().manual_seed(0)
    side = 5
    table = torch.randn(1, 3, side, side, generator=g, dtype=torch.float64)
    for h, w in ((2, 8), (7, 3), (5, 5)):
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        r, c = r.flatten(), c.flatten()
        grid = torch.stack([(c + 0.5) / w * 2 - 1, (r + 0.5) / h * 2 - 1], -1).to(torch.float64)[None, :, None]
        want = F.grid_sample(table, grid, mode="bicubic", padding_mode="border", align_corners=False)[0, :, :, 0].T
        (tr, wr), (tc, wc) = RESAMPLING["bicubic"](r, h, side), RESAMPLING["bicubic"](c, w, side)
        flat = table[0].reshape(3, -1).T
        got = torch.einsum("pij,pijc->pc", wr[:, :, None].double() * wc[:, None, :].double(),
                           flat[tr[:, :, None] * side + tc[:, None, :]])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-6)     # (float32 weights)


def test_positions_equal_transformers_rope_index(saved):
    model, _, cfg = saved
    ids, pixels = rows()
    inputs = hf_inputs(ids, pixels)
    want, _ = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    got = entries(ids, pixels, cfg)["mrope_positions"]
    torch.testing.assert_close(got.permute(2, 0, 1), want, rtol=0, atol=0)


def test_logits_equal_transformers(saved):
    assert_logits_equal_hf(CASE, *saved, atol=5e-5)


def test_loss_and_every_gradient_equal_transformers(saved):
    # (transformers' rotary tables and position resampling run in float32 whatever the dtype)
    names = assert_loss_and_grads_equal_hf(CASE, saved[1], saved[2])
    assert {"model.visual.downsample.weight", "model.visual.blocks.1.attn.qkv.weight"} <= names


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_fsdp_and_tp_equal_one_device(saved, layout):
    assert_rows_layout_equals_one_device(CASE, saved[1], saved[2], layout)


def test_bad_inputs_are_refused_by_name(saved):
    _, d, cfg = saved
    ids, pixels = rows()
    batch = CASE.batch(ids, pixels, cfg)
    bilinear = qwen_image_batch(ids, pixels, [torch.tensor(gr) if gr else None for gr in GRIDS], merge=2,
                                image_token_id=IMAGE, side=3, channels=3, temporal_patch=2, patch=4)
    batch.update(patch_taps=bilinear["patch_taps"], patch_tap_weights=bilinear["patch_tap_weights"])
    with pytest.raises(ValueError, match="resamples its position table bicubically \\(16 taps per patch\\), the "
                                         "batch has 4"):
        single_device(cfg, hf.load_hf_params(d, cfg, dtype=torch.float64), batch)
    with pytest.raises(ValueError, match="resample='nearest' is not one of"):
        qwen_image_batch(ids, pixels, [None] * 4, merge=2, image_token_id=IMAGE, side=3, channels=3,
                         temporal_patch=2, patch=4, resample="nearest")
    raw = json.loads((d / "config.json").read_text())
    with pytest.raises(ValueError, match="vision_config.patch_size=\\[4, 4\\] is not supported"):
        llama_hf.vision_from_hf({**raw, "vision_config": {**raw["vision_config"], "patch_size": [4, 4]}})
    with pytest.raises(ValueError, match="out_hidden_size=16 \\(the merger's output\\) is not the text decoder's "
                                         "hidden_size=32"):
        llama.init(dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, out_hidden=16)))


def test_export_writes_the_multimodal_class(saved, tmp_path):
    assert_export_equals_hf(CASE, saved[1], saved[2], tmp_path / "out", "glm4v")


def test_glm46v_and_the_text_decoder_alone(tmp_path):
    """transformers' ``Glm46VForConditionalGeneration`` (the same model) reads as glm46v and equals
    ours; the checkpoint's text decoder loads alone (its tower left aside) with transformers' text logits."""
    if not hasattr(transformers, "Glm46VForConditionalGeneration"):
        pytest.skip("transformers without Glm46V")
    model, cfg = build(tmp_path, transformers.Glm46VForConditionalGeneration, transformers.Glm46VConfig, seed=1)
    assert (cfg.text_of, cfg.vision.tower) == ("glm46v", "glm4v")
    params = hf.load_hf_params(tmp_path, cfg)
    ids, pixels = rows(seed=5)
    with torch.no_grad():
        want, text_want = model(**hf_inputs(ids, pixels)).logits, model(input_ids=ids).logits
    torch.testing.assert_close(CASE.logits(params, cfg, ids, pixels), want, atol=5e-5, rtol=1e-5)
    text_cfg, text_params = hf.load_hf_llama(tmp_path)
    assert text_cfg.vision is None and text_cfg.text_of == "glm46v"
    torch.testing.assert_close(CASE.logits(text_params, text_cfg, ids), text_want, rtol=1e-5, atol=1e-5)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    cfg = saved[2]
    small = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, layers=1))
    # (atol: the key biases' gradient is 0 up to rounding, softmax ignoring a shift common to every key,
    # and Adam's step of that rounding differs by 3e-12 between the layouts)
    params = assert_processes_equal_one_device(CASE, small, atol=1e-10)
    assert any(p.startswith("vision_tower.downsample") for p in params)


def test_lora_step_equals_peft(saved, tmp_path):
    """LoRA (r 4, B random and nonzero) on the modules peft's regex names (the decoder's attention
    and down projections, the tower's and the merger's gated MLPs) of transformers' model: our loss
    with images and every adapter gradient of one step equal peft's (float64); the adapters written
    as a PEFT directory load in peft with the same logits."""
    import peft

    from functional_pp import adapters
    from functional_pp.adapters import peft_dir
    _, d, cfg = saved
    targets = (r"(model\.language_model\..*\.(q_proj|k_proj|v_proj|o_proj|down_proj))"
               r"|((model\.)?visual\.(blocks\.\d+\.mlp|merger)\.(gate_proj|up_proj|down_proj))")
    # (transformers' rotary tables and position resampling are float32 whatever the dtype)
    run = assert_lora_equals_peft(CASE, d, cfg, targets, seed=3, rows_seed=6, count=2 * (5 * 2 + 3 * 2 + 3),
                                  floor=1e-9)
    assert any(".visual.merger.gate_proj." in k for k in run.grads) and not any(".attn." in k for k in run.grads)
    out = peft_dir.save_adapter(tmp_path / "adapter", adapters.split(run.full)[1], run.lc, str(d))
    loaded = peft.PeftModel.from_pretrained(CASE.hf_model(d), str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**hf_inputs(*run.rows)).logits[:, :-1], run.logits, rtol=0, atol=0)


def test_a_published_layout_config_reads():
    """GLM-4.6V-Flash's config.json shape (transformers 4.x keys: ``rope_scaling`` holding
    ``mrope_section``, ``partial_rotary_factor`` and ``rope_theta`` at the text config's top level):
    the decoder's rotary is 64 of 128 dims in 8 + 12 + 12 pairs, the tower reads its sizes."""
    raw = {"model_type": "glm4v", "image_token_id": 151363,
           "text_config": {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
                           "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
                           "partial_rotary_factor": 0.5, "rope_theta": 10000, "rms_norm_eps": 1e-05,
                           "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]},
                           "attention_bias": True, "model_type": "glm4v_text", "pad_token_id": 151329},
           "vision_config": {"hidden_size": 1536, "depth": 24, "num_heads": 12, "intermediate_size": 10944,
                             "image_size": 336, "patch_size": 14, "out_hidden_size": 4096, "spatial_merge_size": 2}}
    cfg, v = hf.config_from_hf(raw), llama_hf.vision_from_hf(raw)
    assert (cfg.text_of, cfg.dim_head, cfg.rotary_dim, cfg.mrope_section, cfg.rope_theta) == ("glm4v", 128, 64,
                                                                                             (8, 12, 12), 10000.0)
    assert (cfg.kv_heads, cfg.norm_eps, cfg.qkv_bias, cfg.sandwich_norms, cfg.rotary_interleaved) == (2, 1e-5, True,
                                                                                                    True, True)
    assert (v.side, v.out_hidden, v.merger_mlp, v.image_token_id, v.resample) == (24, 4096, 10944, 151363, "bicubic")
    assert glm4v_hf.CLASSES[raw["model_type"]] == "Glm4vForConditionalGeneration"
