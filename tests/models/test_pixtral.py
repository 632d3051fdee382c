"""A vision-language model (Mistral 3: Pixtral's encoder, the projector with its patch merger, the
text decoder; models/pixtral.py) equals transformers' ``Mistral3ForConditionalGeneration`` on a
tiny random checkpoint: logits, fp64 loss and every gradient; FSDP, TP and CP on two simulated
devices and DP x FSDP on real gloo processes equal one device (LLaVA-1.5's CLIP tower in the same
launch: models/clip.py); bad image inputs are refused."""
import dataclasses

import pytest
import torch
from harness import single_device
from vision_harness import (assert_export_equals_hf, assert_logits_equal_hf, assert_loss_and_grads_equal_hf,
                            assert_rows_layout_equals_one_device, assert_runs_on_processes_equal_one_device,
                            renaming, saved_config, sized_case)

import functional_pp as fpp
from functional_pp import ops
from functional_pp.checkpoint import hf
from functional_pp.data.images import image_batch
from functional_pp.models import pixtral, pixtral_hf

transformers = pytest.importorskip("transformers")

IMAGE = 400
TEXT = dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=512)
VISION = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=64, patch_size=4, initializer_range=0.2)
SIZES = [[(16, 16), (8, 8)], [(8, 16)], [], [(8, 8)]]      # per row: its images' (height, width) in pixels
# each row's image tokens (one per 2 x 2 patches of 4 pixels) in 16 x 16 pixels
CASE = sized_case("Mistral3ForConditionalGeneration", IMAGE, SIZES, 16,
                  {0: [(2, 6), (8, 9)], 1: [(5, 7)], 3: [(9, 10)]}, seq=14, patch=4, merge=2)
FILES_TO_MODULES = renaming(("language_model.model.", "model.language_model."),
                            ("vision_tower.", "model.vision_tower."),
                            ("multi_modal_projector.", "model.multi_modal_projector."),
                            ("language_model.lm_head.", "lm_head."))
"""The files' (older) tensor names -> transformers 5's module names."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    conf = transformers.Mistral3Config(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE,
                                       spatial_merge_size=2, initializer_range=0.2, multimodal_projector_bias=True)
    model = transformers.Mistral3ForConditionalGeneration(conf).eval()
    with torch.no_grad():                       # the norms and biases off their initial values
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("mistral3")
    return model, d, saved_config(model, d)


def test_logits_equal_transformers(saved):
    assert_logits_equal_hf(CASE, *saved, atol=1e-5)


def test_loss_and_every_gradient_equal_transformers(saved):
    _, d, cfg = saved
    names = assert_loss_and_grads_equal_hf(CASE, d, cfg, rtol=1e-5, scale=1e-6, module=FILES_TO_MODULES)
    assert any(name.startswith("vision_tower.") for name in names)


@pytest.mark.parametrize("layout", ["fsdp", "tp", "cp"])         # (cp: the sequence over cp, balanced)
def test_fsdp_tp_and_cp_equal_one_device(saved, layout):
    assert_rows_layout_equals_one_device(CASE, saved[1], saved[2], layout, seq=17)


def test_masked_scatter_equals_torch_on_a_split_sequence():
    g = torch.Generator().manual_seed(0)
    x, src = torch.randn(2, 8, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [1, 2, 6]], mask[1, [0, 7]] = True, True
    index = torch.full((2, 8), -1)
    for b in range(2):
        index[b, mask[b]] = torch.arange(int(mask[b].sum()))
    want = torch.stack([x[b].masked_scatter(mask[b, :, None], src[b]) for b in range(2)])
    got = ops.masked_scatter(fpp.wrap(x, "batch seq hidden"), fpp.wrap(src, "batch merged hidden"),
                             fpp.wrap(index, "batch seq"), "merged").value()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    mesh, rules = fpp.Mesh(cp=2), fpp.Rules(seq="cp")

    def device():
        with fpp.use_rules(rules):
            out = ops.masked_scatter(fpp.named(x, "batch seq hidden"), fpp.named(src, "batch merged hidden"),
                                     fpp.named(index, "batch seq"), "merged")
            return fpp.gather_tree({"y": out.data}, {"y": fpp.param((2, 8, 4), "batch seq hidden")}, rules)["y"]
    for y in fpp.launch(device, mesh):
        torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_bad_image_inputs_are_refused_by_name(saved):
    _, d, cfg = saved
    ids, pixels = CASE.rows()
    ids[0, 8] = 5                                   # one image token too few in row 0
    with pytest.raises(ValueError, match=r"row 0 holds 4 image tokens \(id 400\) but its 2 images make 5"):
        CASE.entries(ids, pixels)
    with pytest.raises(ValueError, match=r"12 x 8 pixels is 3 x 2 patches of 4, not a positive multiple of "
                                         r"spatial_merge_size=2"):
        image_batch(ids[:1], [torch.zeros(1, 3, 16, 16)], [torch.tensor([[12, 8]])], patch=4, merge=2,
                    image_token_id=IMAGE)
    with pytest.raises(ValueError, match="vision_feature_layer=-2 is not supported"):
        pixtral_hf.vision_from_hf({"model_type": "mistral3", "vision_feature_layer": -2, "vision_config": {}})
    with pytest.raises(ValueError, match="images of model_type 'llava' \\(processor_type; vision tower "
                                         "'siglip_vision_model'\\) are not supported yet"):
        pixtral_hf.vision_from_hf({"model_type": "llava", "vision_config": {"model_type": "siglip_vision_model"}})
    text = dataclasses.replace(cfg, vision=None)
    with pytest.raises(ValueError, match="the batch carries images but the model has no vision encoder"):
        single_device(text, hf.load_hf_params(d, text, dtype=torch.float64), CASE.batch(*CASE.rows(), text))


# LLaVA-1.5's rows around the same decoder: 8 x 8 images (4 image tokens each; rows of seeds 10 and 11)
CLIP_CASE = sized_case("LlavaForConditionalGeneration", IMAGE, [[(8, 8)] * 2, [], [(8, 8)], []], 8,
                       {0: [(1, 5), (7, 11)], 2: [(3, 7)]}, seq=14, image_sizes=False, patch=4, merge=1,
                       class_token="dropped", image_size=8)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    """Mistral 3 (a Pixtral tower) and LLaVA-1.5 (a CLIP tower: its class token dropped, the
    second-to-last layer's states) around the same decoder in one launch of 4 gloo processes."""
    cfg = saved[2]
    small = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, layers=1))
    clip = dataclasses.replace(cfg, text_of="llava", vision=pixtral.VisionConfig(
        hidden=32, layers=2, heads=2, mlp=64, patch_size=4, image_size=8, merge=1, projector="llava",
        projector_bias=True, tower="clip", feature_layer=-2, select_strategy="default", act="quick_gelu",
        image_token_id=IMAGE))
    ones = assert_runs_on_processes_equal_one_device([
        (small, [CASE.batch(*CASE.rows(seed=s, dtype=torch.float64), small) for s in range(2)]),
        (clip, [CLIP_CASE.batch(*CLIP_CASE.rows(seed=10 + s, dtype=torch.float64), clip) for s in range(2)])])
    assert all(any(p.startswith("vision_tower.") for p in one) for one in ones)
    assert any(p.startswith("vision_tower.class_embedding") for p in ones[1])


def test_llava_with_a_pixtral_tower_equals_transformers(tmp_path):
    """Pixtral 12B's layout (``LlavaForConditionalGeneration`` with a Pixtral tower: no patch merger, the
    projector linear-GELU-linear with biases, ``vision_feature_select_strategy: full``): the fp64 loss
    and every gradient equal transformers'."""
    torch.manual_seed(1)
    conf = transformers.LlavaConfig(text_config=TEXT, vision_config=dict(VISION, num_hidden_layers=1),
                                    image_token_index=IMAGE, vision_feature_layer=-1,
                                    vision_feature_select_strategy="full", initializer_range=0.2)
    cfg = saved_config(transformers.LlavaForConditionalGeneration(conf), tmp_path)
    assert (cfg.vision.projector, cfg.vision.merge, cfg.text_of) == ("llava", 1, "llava")
    # 4 and 2 patches, 2 patches (8 x 8 pixels): one token each
    case = sized_case("LlavaForConditionalGeneration", IMAGE, [[(8, 8), (4, 8)], [(8, 4)]], 8,
                      {0: [(2, 6), (7, 9)], 1: [(4, 6)]}, seq=12, patch=4, merge=1)
    names = assert_loss_and_grads_equal_hf(case, tmp_path, cfg, seed=3, rtol=1e-5, scale=1e-6, module=FILES_TO_MODULES)
    assert "multi_modal_projector.linear_1.bias" in names


def test_export_writes_the_multimodal_class(saved, tmp_path):
    """A vision-language model's export is its multimodal class (config and tensors under their HF
    names), which transformers loads with our logits, images and all; read back, the same config."""
    _, d, cfg = saved
    assert_export_equals_hf(CASE, d, cfg, tmp_path / "hf", "mistral3", rtol=1e-5, atol=1e-5)
