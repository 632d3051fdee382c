"""LFM2-VL (models/lfm2_vl.py: SigLIP2's NaFlex tower, models/siglip2.py, with CLIP's encoder layers;
the pixel-unshuffle projector; the LFM2 decoder; data/siglip2_images.py's entries) equals transformers'
``Lfm2VlForConditionalGeneration`` on a tiny random checkpoint: logits, fp64 loss and every gradient,
LoRA on the decoder equal to peft's; FSDP and TP on two simulated devices and DP x FSDP on real gloo
processes equal one device; the hub's file names read; export writes the multimodal class, which
transformers loads with our logits; bad inputs are refused by name."""
import pytest
import torch
from harness import single_device
from vision_harness import (ImageRows, assert_export_equals_hf, assert_logits_equal_hf, assert_lora_equals_peft,
                            assert_loss_and_grads_equal_hf, assert_processes_equal_one_device,
                            assert_rows_layout_equals_one_device, saved_config)

from functional_pp import adapters
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.data.siglip2_images import position_weights, siglip2_image_batch
from functional_pp.models import lfm2_vl_hf, llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Lfm2VlForConditionalGeneration"):
    pytest.skip("transformers without LFM2-VL", allow_module_level=True)

IMAGE = 400
TEXT = dict(model_type="lfm2", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, layer_types=["conv", "full_attention"], initializer_range=0.2)
VISION = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, patch_size=4, num_patches=16, vision_use_head=False)
SHAPES = [[(4, 6), (2, 2)], [(6, 2)], [], [(2, 8)]]    # per row: its images' (height, width) in patches (side 4:
MAX_PATCHES = 24                                       # up- and down-sampled position tables both)
PATCH = 4 * 4 * 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    conf = transformers.Lfm2VlConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                                     projector_hidden_size=48, downsample_factor=2)
    model = transformers.Lfm2VlForConditionalGeneration(conf).eval()
    with torch.no_grad():                       # the norms and biases off their initial values
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("lfm2_vl")
    return model, d, saved_config(model, d)


def rows(seed=0, seq=16, dtype=torch.float32):
    """Token rows with each row's image tokens (one per 2 x 2 patches) and its images' patches, as the
    image processor gives them (each image a row of MAX_PATCHES, padded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (len(SHAPES), seq), generator=g)
    ids[0, 1:7], ids[0, 9], ids[1, 4:7], ids[3, 10:14] = IMAGE, IMAGE, IMAGE, IMAGE
    pixels = []
    for s in SHAPES:
        x = torch.zeros(len(s), MAX_PATCHES, PATCH, dtype=dtype)
        for j, (h, w) in enumerate(s):
            x[j, :h * w] = torch.randn(h * w, PATCH, generator=g, dtype=dtype)
        pixels.append(x if s else None)
    return ids, pixels


def hf_inputs(ids, pixels):
    shapes = torch.tensor([x for s in SHAPES for x in s])
    mask = (torch.arange(MAX_PATCHES) < shapes.prod(-1)[:, None]).long()
    return dict(input_ids=ids, pixel_values=torch.cat([p for p in pixels if p is not None]), spatial_shapes=shapes,
                pixel_attention_mask=mask)


def entries(ids, pixels, cfg=None):
    return siglip2_image_batch(ids, pixels, [torch.tensor(s) if s else None for s in SHAPES], merge=2,
                               image_token_id=IMAGE, side=4, channels=3, patch=4)


CASE = ImageRows("Lfm2VlForConditionalGeneration", IMAGE, rows, hf_inputs, entries)


def test_logits_equal_transformers(saved):
    cfg = saved[2]
    assert (cfg.model_type, cfg.text_of, cfg.vision.tower, cfg.vision.projector_hidden) == ("lfm2", "lfm2_vl",
                                                                                          "siglip2", 48)
    assert_logits_equal_hf(CASE, *saved, atol=1e-5)


def test_position_weights_resample_the_table_as_transformers():
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings
    table = torch.randn(4, 4, 5, dtype=torch.float64)
    for h, w in ((2, 2), (4, 6), (7, 3), (1, 9)):
        want = Siglip2VisionEmbeddings.resize_positional_embeddings(table, torch.tensor([[h, w]]), h * w)[0]
        torch.testing.assert_close(position_weights(h, w, 4).double() @ table.reshape(16, 5), want, rtol=1e-6,
                                   atol=1e-7)


def test_loss_and_every_gradient_equal_transformers(saved):
    # (transformers resamples the position table in float32 whatever the dtype: the k biases' gradients, zero
    # in exact arithmetic, are 1e-9 there; the files' names are the modules')
    names = assert_loss_and_grads_equal_hf(CASE, saved[1], saved[2], floor=1e-8)
    assert any(name.startswith("model.vision_tower.encoder.layers.1.") for name in names)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_fsdp_and_tp_equal_one_device(saved, layout):
    assert_rows_layout_equals_one_device(CASE, saved[1], saved[2], layout)


def test_lora_on_axolotls_targets_equals_peft(saved):
    """The example config's ``lora_target_modules`` regex (the decoder's q / k / v) on rows with images:
    our loss and every adapter gradient of one step equal peft's on transformers' model."""
    _, d, cfg = saved
    regex = r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"
    peft = assert_lora_equals_peft(CASE, d, cfg, regex, seed=3, rows_seed=5, count=6, rtol=1e-5)
    assert sorted({k.split(".lora_")[0] for k in peft.grads}) == [
        f"base_model.model.model.language_model.layers.1.self_attn.{m}_proj" for m in "kqv"]


def test_the_hubs_file_names_read(saved, tmp_path):
    """The hub's LFM2-VL files hold the tower under ``model.vision_tower.vision_model.`` (transformers 4's
    Siglip2VisionModel): read as the same parameters."""
    from safetensors.torch import load_file, save_file
    _, d, cfg = saved
    sd = load_file(str(d / "model.safetensors"))
    save_file({k.replace("model.vision_tower.", "model.vision_tower.vision_model.", 1): v for k, v in sd.items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    want, got = hf.load_hf_params(d, cfg), hf.load_hf_params(tmp_path, cfg)
    for (p, a), (_, b) in zip(tree.leaves_with_paths(want), tree.leaves_with_paths(got)):
        assert torch.equal(a, b), p


def test_export_writes_the_multimodal_class(saved, tmp_path):
    """Moved off the checkpoint, exported: ``Lfm2VlForConditionalGeneration``'s config (read back as the
    same), the checkpoint's tensor names, and transformers loads it with our logits on rows with images."""
    assert_export_equals_hf(CASE, saved[1], saved[2], tmp_path / "out", "lfm2_vl")


def test_bad_inputs_are_refused_by_name(saved):
    _, d, cfg = saved
    ids, pixels = rows()
    ids[0, 9] = 5                                   # one image token too few in row 0
    with pytest.raises(ValueError, match=r"row 0 holds 6 image tokens \(id 400\) but its 2 images make 7"):
        entries(ids, pixels)
    with pytest.raises(ValueError, match=r"row 0's image 0 is 3 x 2 patches, not a positive multiple of "
                                         r"downsample_factor=2"):
        siglip2_image_batch(torch.full((1, 4), IMAGE), [torch.zeros(1, 6, PATCH)], [torch.tensor([[3, 2]])],
                            merge=2, image_token_id=IMAGE, side=4, channels=3, patch=4)
    with pytest.raises(ValueError, match="taps=2 is fewer than the 9 position weights"):
        siglip2_image_batch(*rows()[:1], rows()[1], [torch.tensor(s) if s else None for s in SHAPES], merge=2,
                            image_token_id=IMAGE, side=4, channels=3, patch=4, taps=2)
    with pytest.raises(ValueError, match="num_patches=15 must be a square"):
        lfm2_vl_hf.vision_from_hf({"model_type": "lfm2_vl", "vision_config": dict(VISION, num_patches=15)})
    with pytest.raises(ValueError, match="needs \\['patch_taps', 'patch_tap_weights'\\] too"):
        batch = CASE.batch(*rows(), cfg)
        del batch["patch_taps"], batch["patch_tap_weights"]
        single_device(cfg, hf.load_hf_params(d, cfg, dtype=torch.float64), batch)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    assert any(p.startswith("vision_tower.encoder.layers.") for p in assert_processes_equal_one_device(CASE, saved[2]))


def test_peft_adapter_export_loads_in_peft_with_our_logits(saved, tmp_path):
    """LoRA on the decoder (Axolotl's regex: q / k / v) and on the tower's and projector's linears, written as
    a PEFT directory for base_model: peft loads it into transformers' Lfm2VlForConditionalGeneration (the
    modules of transformers 5: ``model.language_model.``, ``model.vision_tower.``) with our logits on rows
    with images, and it reads back as the same adapters."""
    import peft

    from functional_pp.adapters import peft_dir
    from harness import random_lora
    _, d, cfg = saved
    regex = (r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj|"
             r"vision_tower.encoder.layers.[\d]+.mlp.fc1|multi_modal_projector.linear_1")
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=regex)
    decls = adapters.init(llama.init(cfg), lc, cfg.model_type)
    lora = random_lora(decls, torch.Generator().manual_seed(9))
    assert len(lora) == 3 + 2 + 1
    out = peft_dir.save_adapter(tmp_path / "adapter", lora, lc, str(d))
    model = transformers.Lfm2VlForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    pm = peft.PeftModel.from_pretrained(model, str(out)).eval()
    ids, pixels = rows(seed=6)
    with torch.no_grad():
        want = pm(**hf_inputs(ids, pixels)).logits
    got = CASE.logits(adapters.joined(hf.load_hf_params(d, cfg), lora), cfg, ids, pixels, lc=lc)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    base = CASE.logits(hf.load_hf_params(d, cfg), cfg, ids, pixels)
    assert (base - want).abs().max() > 1e-3                          # (the adapters act)
    from safetensors.torch import load_file
    back = peft_dir.from_peft(load_file(str(out / peft_dir.WEIGHTS)), decls, "lfm2_vl")
    for p, ab in lora.items():
        for part in ("lora_A", "lora_B"):
            torch.testing.assert_close(back[p][part], ab[part], rtol=0, atol=0)
