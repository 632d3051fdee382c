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
from harness import parallel, single_device, train_steps

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.data.images import IMAGE_DIMS
from functional_pp.data.qwen_images import RESAMPLING, qwen_image_batch
from functional_pp.models import glm4v_hf, llama, llama_hf
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Glm4vForConditionalGeneration"):
    pytest.skip("transformers without GLM-4V", allow_module_level=True)

IMAGE = 250
TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, initializer_range=0.2, max_position_embeddings=128,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[2, 1, 1]))
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=4,
              image_size=12, temporal_patch_size=2, spatial_merge_size=2, initializer_range=0.2)
GRIDS = [[(1, 4, 6), (1, 2, 2)], [(1, 2, 4)], [], [(1, 6, 2)]]   # per row: its images' (t, h, w) in patches
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
    model.save_pretrained(tmp, safe_serialization=True)
    raw = json.loads((tmp / "config.json").read_text())
    return model, dataclasses.replace(hf.config_from_hf(raw), vision=llama_hf.vision_from_hf(raw))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm4v")
    model, cfg = build(d)
    return model, d, cfg


def rows(seed=0, seq=16, dtype=torch.float32):
    """Token rows with each row's image tokens (one per 2 x 2 patches) and its patches' pixels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 240, (len(GRIDS), seq), generator=g)
    ids[0, 2:8], ids[0, 10], ids[1, 5:7], ids[3, 9:12] = IMAGE, IMAGE, IMAGE, IMAGE
    pixels = [torch.randn(sum(t * h * w for t, h, w in gr), PATCH, generator=g, dtype=dtype) if gr else None
              for gr in GRIDS]
    return ids, pixels


def hf_inputs(ids, pixels):
    return dict(input_ids=ids, pixel_values=torch.cat([p for p in pixels if p is not None]),
                image_grid_thw=torch.tensor([x for gr in GRIDS for x in gr]),
                mm_token_type_ids=(ids == IMAGE).int())


def entries(ids, pixels, cfg):
    v = cfg.vision
    return qwen_image_batch(ids, pixels, [torch.tensor(gr) if gr else None for gr in GRIDS], merge=v.merge,
                            image_token_id=IMAGE, side=v.side, channels=v.channels, temporal_patch=v.temporal_patch,
                            patch=v.patch_size, resample=v.resample)


def labels_of(ids):
    """Next-token labels with the image tokens masked (-100), as Axolotl's multimodal collator."""
    lab = ids[:, 1:].clone()
    lab[lab == IMAGE] = -100
    return lab


def batch_of(ids, pixels, cfg):
    cut = {"image_slots", "mrope_positions"}
    b = {k: v[:, :-1] if k in cut else v for k, v in entries(ids, pixels, cfg).items()}
    return {"tokens": ids[:, :-1], "labels": labels_of(ids), **b}


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
    model, d, cfg = saved
    params = hf.load_hf_params(d, cfg)
    ids, pixels = rows()
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
        named = sharding.named_tree(params, llama.init(cfg))
        images = {k: fpp.wrap(v, IMAGE_DIMS[k]) for k, v in entries(ids, pixels, cfg).items()}
        got = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg, images=images).value()
        flat = {k: v for k, v in images.items() if k != "mrope_positions"}      # (images, text positions)
        no_mrope = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg, images=flat).value()
        text_only = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg).value()
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    assert (text_only - want).abs().max() > 0.1          # the images matter
    assert (no_mrope - want).abs().max() > 1e-3          # so do their 3D positions
    torch.testing.assert_close(text_only[2], want[2], atol=1e-5, rtol=1e-5)     # (row 2: no image)
