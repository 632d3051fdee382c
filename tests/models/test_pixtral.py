"""A vision-language model (Mistral 3: Pixtral's encoder, the projector with its patch merger, the
text decoder; models/pixtral.py) equals transformers' ``Mistral3ForConditionalGeneration`` on a
tiny random checkpoint: logits, fp64 loss and every gradient; FSDP, TP and CP on two simulated
devices and DP x FSDP on real gloo processes equal one device (LLaVA-1.5's CLIP tower in the same
launch: models/clip.py); bad image inputs are refused."""
import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from harness import local_batch, parallel, single_device, train_steps

import functional_pp as fpp
from functional_pp import ops
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.data.images import IMAGE_DIMS, image_batch
from functional_pp.models import llama, pixtral, pixtral_hf
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")

IMAGE = 400
TEXT = dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=512)
VISION = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=64, patch_size=4, initializer_range=0.2)
SIZES = [[(16, 16), (8, 8)], [(8, 16)], [], [(8, 8)]]      # per row: its images' (height, width) in pixels


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
    model.save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    cfg = dataclasses.replace(hf.config_from_hf(raw), vision=pixtral_hf.vision_from_hf(raw))
    return model, d, cfg


def rows(seed=0, seq=14, dtype=torch.float32):
    """Token rows with each row's image tokens (one per 2 x 2 patches of 4 pixels) and its pixels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (len(SIZES), seq), generator=g)
    ids[0, 2:6], ids[0, 8], ids[1, 5:7], ids[3, 9] = IMAGE, IMAGE, IMAGE, IMAGE
    pixels = [torch.randn(len(s), 3, 16, 16, generator=g, dtype=dtype) if s else None for s in SIZES]
    return ids, pixels


def hf_inputs(ids, pixels):
    have = [p for p in pixels if p is not None]
    return dict(input_ids=ids, pixel_values=torch.cat(have),
                image_sizes=torch.tensor([x for s in SIZES for x in s]))


def entries(ids, pixels):
    return image_batch(ids, pixels, [torch.tensor(s) if s else None for s in SIZES], patch=4, merge=2,
                       image_token_id=IMAGE)


def labels_of(ids):
    """Next-token labels with the image tokens masked (-100), as Axolotl's multimodal collator."""
    lab = ids[:, 1:].clone()
    lab[lab == IMAGE] = -100
    return lab


def batch_of(ids, pixels):
    b = {k: v[:, :-1] if k == "image_slots" else v for k, v in entries(ids, pixels).items()}
    return {"tokens": ids[:, :-1], "labels": labels_of(ids), **b}


def test_logits_equal_transformers(saved):
    model, d, cfg = saved
    params = hf.load_hf_params(d, cfg)
    ids, pixels = rows()
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
        named = sharding.named_tree(params, llama.init(cfg))
        images = {k: fpp.wrap(v, IMAGE_DIMS[k]) for k, v in entries(ids, pixels).items()}
        got = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg, images=images).value()
        text_only = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg).value()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (text_only - want).abs().max() > 0.1          # the images matter


def test_loss_and_every_gradient_equal_transformers(saved):
    _, d, cfg = saved
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(d, dtype=torch.float64,
                                                                         attn_implementation="eager")
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    ids, pixels = rows(seed=1, dtype=torch.float64)
    loss, grads = single_device(cfg, params, batch_of(ids, pixels))
    logits = model(**hf_inputs(ids, pixels)).logits[:, :-1]
    want = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels_of(ids).reshape(-1))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    legacy = {"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.",
              "model.multi_modal_projector.": "multi_modal_projector.", "lm_head.": "language_model.lm_head."}
    for n in list(hf_grads):                       # (the module names of transformers 5; the files' are older)
        for new, old in legacy.items():
            if n.startswith(new):
                hf_grads[n.replace(new, old, 1)] = hf_grads.pop(n)
    ours = dict(tree.leaves_with_paths(grads))
    files = hf._file_tensors(llama.init(cfg), cfg)
    assert {name for name, _ in files} == set(hf_grads)
    assert any(name.startswith("vision_tower.") for name, _ in files)
    for name, parts in files:
        (p, kind, _), = parts
        torch.testing.assert_close(kind.to_hf(ours[p]), hf_grads[name], rtol=1e-5,
                                   atol=max(1e-6 * hf_grads[name].abs().max().item(), 1e-9),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mesh, rules", [(fpp.Mesh(dp_shard=2), "fsdp"), (fpp.Mesh(tp=2), "tp"), (fpp.Mesh(cp=2), "cp")])
def test_fsdp_tp_and_cp_equal_one_device(saved, mesh, rules):
    _, d, cfg = saved
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    rules = llama.default_rules(tp=rules == "tp", fsdp=rules == "fsdp")     # (cp: the sequence over cp, balanced)
    ids, pixels = rows(seed=2, seq=17, dtype=torch.float64)
    batch = batch_of(ids, pixels)
    loss0, grads0 = single_device(cfg, params, batch)
    for rank, (loss, grads, _) in enumerate(parallel(cfg, params, batch, mesh, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


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
    _, _, cfg = saved
    ids, pixels = rows()
    ids[0, 8] = 5                                   # one image token too few in row 0
    with pytest.raises(ValueError, match=r"row 0 holds 4 image tokens \(id 400\) but its 2 images make 5"):
        entries(ids, pixels)
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
        single_device(text, hf.load_hf_params(saved[1], text, dtype=torch.float64), batch_of(*rows()))


def _clip_case(cfg):
    """LLaVA-1.5's layout (a CLIP tower, its class token dropped, the second-to-last layer's states)
    around the same decoder, and two batches of 8 x 8 images (4 image tokens each)."""
    vision = pixtral.VisionConfig(hidden=32, layers=2, heads=2, mlp=64, patch_size=4, image_size=8, merge=1,
                                  projector="llava", projector_bias=True, tower="clip", feature_layer=-2,
                                  select_strategy="default", act="quick_gelu", image_token_id=IMAGE)
    data = []
    for seed in range(2):
        g = torch.Generator().manual_seed(10 + seed)
        ids = torch.randint(0, 300, (4, 14), generator=g)
        ids[0, 1:5], ids[0, 7:11], ids[2, 3:7] = IMAGE, IMAGE, IMAGE
        pixels = [torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) if n else None for n in (2, 0, 1, 0)]
        ent = image_batch(ids, pixels, [torch.tensor([[8, 8]] * n) if n else None for n in (2, 0, 1, 0)], patch=4,
                          merge=1, image_token_id=IMAGE, class_token="dropped", image_size=8)
        data.append({"tokens": ids[:, :-1], "labels": labels_of(ids),
                     **{k: v[:, :-1] if k == "image_slots" else v for k, v in ent.items()}})
    return dataclasses.replace(cfg, vision=vision, text_of="llava"), data


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    """Mistral 3 (a Pixtral tower) and LLaVA-1.5 (a CLIP tower) in one launch of 4 gloo processes."""
    _, d, cfg = saved
    small = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, layers=1))
    cases = [(small, [batch_of(*rows(seed=s, dtype=torch.float64)) for s in range(2)]), _clip_case(cfg)]
    dims = {"tokens": "batch seq", "labels": "batch seq", **IMAGE_DIMS}

    def both(mesh, rules):
        runs = [train_steps(c, data, mesh, rules, batch_dims=dims) for c, data in cases]
        return lambda: [run() for run in runs]
    ones = fpp.launch(both(fpp.Mesh(), fpp.Rules()), fpp.Mesh())[0]
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2)
    for got in fpp.launch(both(mesh, llama.default_rules(tp=False)), mesh, processes=True, timeout=600):
        for (losses, params, _), one in zip(got, ones):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=1e-10, atol=0)
            for p, x in params.items():
                torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one[1][p]), rtol=1e-8, atol=1e-12,
                                           msg=lambda m: f"{p}: {m}")
    assert all(any(p.startswith("vision_tower.") for p in one[1]) for one in ones)
    assert any(p.startswith("vision_tower.class_embedding") for p in ones[1][1])


def test_llava_with_a_pixtral_tower_equals_transformers(tmp_path):
    """Pixtral 12B's layout (``LlavaForConditionalGeneration`` with a Pixtral tower: no patch merger, the
    projector linear-GELU-linear with biases, ``vision_feature_select_strategy: full``): logits and the
    fp64 loss and every gradient equal transformers'."""
    torch.manual_seed(1)
    conf = transformers.LlavaConfig(text_config=TEXT, vision_config=dict(VISION, num_hidden_layers=1),
                                    image_token_index=IMAGE, vision_feature_layer=-1,
                                    vision_feature_select_strategy="full", initializer_range=0.2)
    transformers.LlavaForConditionalGeneration(conf).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    cfg = dataclasses.replace(hf.config_from_hf(raw), vision=pixtral_hf.vision_from_hf(raw))
    assert (cfg.vision.projector, cfg.vision.merge, cfg.text_of) == ("llava", 1, "llava")
    sizes = [[(8, 8), (4, 8)], [(8, 4)]]                   # 4 and 2 patches, 2 patches: one token each
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (2, 12), generator=g)
    ids[0, 2:6], ids[0, 7:9], ids[1, 4:6] = IMAGE, IMAGE, IMAGE
    pixels = [torch.randn(len(s), 3, 8, 8, generator=g, dtype=torch.float64) for s in sizes]
    model = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float64,
                                                                       attn_implementation="eager")
    logits = model(input_ids=ids, pixel_values=torch.cat(pixels),
                   image_sizes=torch.tensor([x for s in sizes for x in s])).logits[:, :-1]
    want = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels_of(ids).reshape(-1))
    want.backward()
    ent = image_batch(ids, pixels, [torch.tensor(s) for s in sizes], patch=4, merge=1, image_token_id=IMAGE)
    batch = {"tokens": ids[:, :-1], "labels": labels_of(ids),
             **{k: v[:, :-1] if k == "image_slots" else v for k, v in ent.items()}}
    loss, grads = single_device(cfg, hf.load_hf_params(tmp_path, cfg, dtype=torch.float64), batch)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    ours = dict(tree.leaves_with_paths(grads))
    files = hf._file_tensors(llama.init(cfg), cfg)
    assert len(files) == len(hf_grads) and any(n.startswith("multi_modal_projector.linear_1.bias") for n, _ in files)
    for name, ((p, kind, _),) in files:
        module = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
                  "multi_modal_projector.": "model.multi_modal_projector.", "language_model.lm_head.": "lm_head."}
        key = next(name.replace(a, b, 1) for a, b in module.items() if name.startswith(a))
        torch.testing.assert_close(kind.to_hf(ours[p]), hf_grads[key], rtol=1e-5,
                                   atol=max(1e-6 * hf_grads[key].abs().max().item(), 1e-9), msg=lambda m: f"{name}: {m}")


def test_export_writes_the_multimodal_class(saved, tmp_path):
    """A vision-language model's export is its multimodal class (config and tensors under their HF
    names), which transformers loads with our logits, images and all; read back, the same config."""
    model, d, cfg = saved
    params = hf.load_hf_params(d, cfg)
    g = torch.Generator().manual_seed(5)
    moved = tree.tree_map(lambda t: t + 0.01 * torch.randn(t.shape, generator=g), params)
    out = hf.save_hf_llama(moved, cfg, tmp_path / "hf")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Mistral3ForConditionalGeneration"]
    again = dataclasses.replace(hf.config_from_hf(raw), vision=pixtral_hf.vision_from_hf(raw))
    assert again == cfg
    loaded = transformers.Mistral3ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    ids, pixels = rows()
    with torch.no_grad():
        want = loaded(**hf_inputs(ids, pixels)).logits
        named = sharding.named_tree(moved, llama.init(cfg))
        images = {k: fpp.wrap(v, IMAGE_DIMS[k]) for k, v in entries(ids, pixels).items()}
        got = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg, images=images).value()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
