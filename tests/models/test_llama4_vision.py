"""Llama 4 with images (models/llama4_vision.py: the vision model's tiles, pixel shuffle, adapter MLP
and projector; one tower of ``Config.vision``) equals transformers' ``Llama4ForConditionalGeneration``
on a tiny random checkpoint: logits, the fp64 loss and every gradient; LoRA on Axolotl's Scout
targets (text and vision) equals peft's; FSDP, TP and CP on two simulated devices, and DP x FSDP on
gloo processes, equal one device; export writes the multimodal class, which transformers loads with
our logits."""
import json

import pytest
import torch
from harness import single_device
from vision_harness import (ImageRows, assert_lora_equals_peft, assert_processes_equal_one_device,
                            assert_rows_layout_equals_one_device, config_of, saved_config)

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.data.images import IMAGE_DIMS, image_batch
from functional_pp.models import llama, llama4_vision_hf
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")

IMAGE = 200
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=3, attn_scale=0.5,
            no_rope_layer_interval=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
            max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 100.0})
VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=16,
              patch_size=4, vision_output_dim=48, projector_input_dim=48, projector_output_dim=48,
              rope_parameters={"rope_type": "default", "rope_theta": 100.0})
TILES = [2, 1, 0, 1]                   # tiles per row (16 x 16 pixels: 16 patches, 4 merged tokens each)


def build():
    torch.manual_seed(0)
    conf = transformers.Llama4Config(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE)
    model = transformers.Llama4ForConditionalGeneration(conf).float().eval()
    with torch.no_grad():              # O(1) features, norms and biases off their initial values
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = build()
    d = tmp_path_factory.mktemp("llama4_vision")
    return model, d, saved_config(model, d)


def rows(seed=0, seq=14, dtype=torch.float32):
    """Token rows with 4 image tokens per tile, and each row's tiles."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 190, (len(TILES), seq), generator=g)
    for b, starts in {0: [1, 8], 1: [4], 3: [9]}.items():
        for s in starts:
            ids[b, s:s + 4] = IMAGE
    pixels = [torch.randn(n, 3, 16, 16, generator=g, dtype=dtype) if n else None for n in TILES]
    return ids, pixels


def entries(ids, pixels, cfg=None):
    return image_batch(ids, pixels, [torch.tensor([[16, 16]] * n) if n else None for n in TILES], patch=4, merge=2,
                       image_token_id=IMAGE, class_token="trailing", image_size=16)


def hf_inputs(ids, pixels):
    return dict(input_ids=ids, pixel_values=torch.cat([p for p in pixels if p is not None]))


CASE = ImageRows("Llama4ForConditionalGeneration", IMAGE, rows, hf_inputs, entries)


def test_config_reads_the_tower(saved):
    _, _, cfg = saved
    v = cfg.vision
    assert (cfg.text_of, v.tower, v.merge, v.grid, v.mlp, v.projector_dim, v.image_token_id) == (
        "llama4", "llama4", 2, 4, 128, 48, IMAGE)


def test_logits_equal_transformers(saved):
    model, d, cfg = saved
    params = hf.load_hf_params(d, cfg)
    ids, pixels = rows()
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
        text_only = model(input_ids=ids).logits
    assert (text_only - want).abs().max() > 0.1             # the images matter
    torch.testing.assert_close(CASE.logits(params, cfg, ids, pixels), want, atol=1e-5, rtol=1e-5)


def test_loss_and_every_gradient_equal_transformers(saved):
    _, d, cfg = saved
    model = CASE.hf_model(d)
    ids, pixels = rows(seed=1, dtype=torch.float64)
    want = CASE.hf_loss(model, ids, pixels)
    loss, grads = single_device(cfg, hf.load_hf_params(d, cfg, dtype=torch.float64), CASE.batch(ids, pixels, cfg))
    torch.testing.assert_close(loss, want, rtol=1e-7, atol=0)   # (its rotary in float32, as ours)
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    ours = dict(tree.leaves_with_paths(grads))
    files = hf._file_tensors(llama.init(cfg), cfg)
    vision = [name for name, _ in files if not name.startswith("language_model.")]
    assert len(vision) == sum(not n.startswith("language_model.") for n in hf_grads) == 10 + 2 * 16
    fused = []
    for name, parts in files:
        if len(parts) > 1:                      # (the experts' gate and up halves of gate_up_proj)
            fused.append(name)
            continue
        (p, kind, _), = parts
        g = hf_grads.pop(name)
        assert g is not None and g.abs().max() > 0, name
        torch.testing.assert_close(kind.to_hf(ours[p]), g, rtol=1e-5, atol=max(1e-6 * g.abs().max().item(), 1e-9),
                                   msg=lambda m: f"{name}: {m}")
    assert fused == ["language_model.model.layers.1.feed_forward.experts.gate_up_proj"], fused
    assert sorted(hf_grads) == fused


@pytest.mark.parametrize("layout", ["fsdp", "tp", "cp"])
def test_fsdp_tp_and_cp_equal_one_device(saved, layout):
    assert_rows_layout_equals_one_device(CASE, saved[1], saved[2], layout, seq=17)


TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "shared_expert.gate_proj",
           "shared_expert.up_proj", "shared_expert.down_proj", "vision_adapter.mlp.fc1", "vision_adapter.mlp.fc2")
"""Axolotl's llama-4/scout-vision-qlora-fsdp2-flex.yaml lora_target_modules (peft matches the vision
model's self_attn too)."""


def test_axolotl_lora_targets_with_images_equal_peft(saved):
    """LoRA (r 4, B random) on the example's targets: our loss and every adapter gradient of a batch
    with images equal peft's on transformers' model (the text decoder's and the vision model's)."""
    _, d, cfg = saved
    # (2 text + 2 vision layers' attention, 1 shared expert; q / k: the rotary in float32)
    run = assert_lora_equals_peft(CASE, d, cfg, list(TARGETS), seed=4, rows_seed=3, count=2 * (4 * 2 + 4 * 2 + 3 + 2))
    assert any("vision_model." in k for k in run.grads)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    """Two AdamW steps with images on 4 gloo processes (DP x FSDP) equal one device."""
    params = assert_processes_equal_one_device(CASE, saved[2], seeds=(5, 6))
    assert any(p.startswith("vision_tower.encoder_layers.") for p in params)


def test_export_writes_the_multimodal_class(saved, tmp_path):
    """The export is ``Llama4ForConditionalGeneration`` (config and tensors under their HF names), which
    transformers loads whole with our logits, images and all; read back, the same config."""
    _, d, cfg = saved
    g = torch.Generator().manual_seed(5)
    moved = tree.tree_map(lambda t: t + 0.01 * torch.randn(t.shape, generator=g), hf.load_hf_params(d, cfg))
    out = hf.save_hf_llama(moved, cfg, tmp_path / "hf")
    raw = json.loads((out / "config.json").read_text())
    assert (raw["architectures"], raw["vision_config"]["model_type"]) == (["Llama4ForConditionalGeneration"],
                                                                          "llama4_vision_model")
    assert config_of(raw) == cfg
    loaded, info = transformers.Llama4ForConditionalGeneration.from_pretrained(out, dtype=torch.float32,
                                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, pixels = rows(seed=7)
    with torch.no_grad():
        want = loaded.eval()(**hf_inputs(ids, pixels)).logits
    torch.testing.assert_close(CASE.logits(moved, cfg, ids, pixels), want, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_by_name(saved):
    _, _, cfg = saved
    ids, pixels = rows()
    with pytest.raises(ValueError, match=r"row 0 holds 8 image tokens \(id 200\) but its 1 images make 4"):
        image_batch(ids, [pixels[0][:1], *pixels[1:]], [torch.tensor([[16, 16]] * n) if n else None
                                                         for n in (1, 1, 0, 1)], patch=4, merge=2,
                    image_token_id=IMAGE, class_token="trailing", image_size=16)
    with pytest.raises(ValueError, match=r"an image of 16 x 8 pixels; a Llama 4 tower takes tiles of 16 x 16"):
        image_batch(ids[:1], [torch.zeros(1, 3, 16, 16)], [torch.tensor([[16, 8]])], patch=4, merge=2,
                    image_token_id=IMAGE, class_token="trailing", image_size=16)
    raw = {"model_type": "llama4", "vision_config": dict(VISION, intermediate_size=64)}
    with pytest.raises(ValueError, match=r"intermediate_size=64 must be hidden_size=32 x \(1 / pixel_shuffle_ratio\)"):
        llama4_vision_hf.vision_from_hf(raw)
    raw["vision_config"] = dict(VISION, vision_output_dim=32)
    with pytest.raises(ValueError, match="must be equal"):
        llama4_vision_hf.vision_from_hf(raw)
    named = sharding.named_tree(hf.load_hf_params(saved[1], cfg), llama.init(cfg))
    images = {k: fpp.wrap(v[:, :-1] if k.startswith("patch") else v, IMAGE_DIMS[k])
              for k, v in entries(ids, pixels).items()}
    with pytest.raises(ValueError, match=r"not a whole number of llama4 tiles of 17"):
        llama.forward(named, fpp.wrap(ids, "batch seq"), cfg, images=images)
