"""LFM2-VL (models/lfm2_vl.py: SigLIP2's NaFlex tower, models/siglip2.py, with CLIP's encoder layers;
the pixel-unshuffle projector; the LFM2 decoder; data/siglip2_images.py's entries) equals transformers'
``Lfm2VlForConditionalGeneration`` on a tiny random checkpoint: logits, fp64 loss and every gradient,
LoRA on the decoder equal to peft's; FSDP and TP on two simulated devices and DP x FSDP on real gloo
processes equal one device; the hub's file names read; export writes the multimodal class, which
transformers loads with our logits; bad inputs are refused by name."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from harness import parallel, peft_lora, single_device, train_adapters, train_steps

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.data.images import IMAGE_DIMS
from functional_pp.data.siglip2_images import position_weights, siglip2_image_batch
from functional_pp.models import lfm2_vl_hf, llama, llama_hf
from functional_pp.parallel import sharding

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
    model.save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    cfg = dataclasses.replace(hf.config_from_hf(raw), vision=llama_hf.vision_from_hf(raw))
    return model, d, cfg


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


def entries(ids, pixels):
    return siglip2_image_batch(ids, pixels, [torch.tensor(s) if s else None for s in SHAPES], merge=2,
                               image_token_id=IMAGE, side=4, channels=3, patch=4)


def labels_of(ids):
    lab = ids[:, 1:].clone()
    lab[lab == IMAGE] = -100
    return lab


def batch_of(ids, pixels):
    b = {k: v[:, :-1] if k == "image_slots" else v for k, v in entries(ids, pixels).items()}
    return {"tokens": ids[:, :-1], "labels": labels_of(ids), **b}


def our_logits(params, cfg, ids, pixels):
    with torch.no_grad():
        named = sharding.named_tree(params, llama.init(cfg, params["embed_tokens"].dtype))
        images = {k: fpp.wrap(v, IMAGE_DIMS[k]) for k, v in entries(ids, pixels).items()}
        return llama.forward(named, fpp.wrap(ids, "batch seq"), cfg, images=images).value()


def test_logits_equal_transformers(saved):
    model, d, cfg = saved
    assert (cfg.model_type, cfg.text_of, cfg.vision.tower, cfg.vision.projector_hidden) == ("lfm2", "lfm2_vl",
                                                                                          "siglip2", 48)
    params = hf.load_hf_params(d, cfg)
    ids, pixels = rows()
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
        text_only = llama.forward(sharding.named_tree(params, llama.init(cfg)), fpp.wrap(ids, "batch seq"),
                                  cfg).value()
    torch.testing.assert_close(our_logits(params, cfg, ids, pixels), want, atol=1e-5, rtol=1e-5)
    assert (text_only - want).abs().max() > 0.1          # the images matter


def test_position_weights_resample_the_table_as_transformers():
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings
    table = torch.randn(4, 4, 5, dtype=torch.float64)
    for h, w in ((2, 2), (4, 6), (7, 3), (1, 9)):
        want = Siglip2VisionEmbeddings.resize_positional_embeddings(table, torch.tensor([[h, w]]), h * w)[0]
        torch.testing.assert_close(position_weights(h, w, 4).double() @ table.reshape(16, 5), want, rtol=1e-6,
                                   atol=1e-7)


def test_loss_and_every_gradient_equal_transformers(saved):
    _, d, cfg = saved
    model = transformers.Lfm2VlForConditionalGeneration.from_pretrained(d, dtype=torch.float64,
                                                                        attn_implementation="eager")
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    ids, pixels = rows(seed=1, dtype=torch.float64)
    loss, grads = single_device(cfg, params, batch_of(ids, pixels))
    logits = model(**hf_inputs(ids, pixels)).logits[:, :-1]
    want = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels_of(ids).reshape(-1))
    want.backward()
    # (transformers resamples the position table in float32 whatever the dtype: the k biases' gradients, zero
    # in exact arithmetic, are 1e-9 there)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)
    hf_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ours = dict(tree.leaves_with_paths(grads))
    files = hf._file_tensors(llama.init(cfg), cfg)
    assert {name for name, _ in files} == set(hf_grads)      # (the files' names are the modules')
    assert any(name.startswith("model.vision_tower.encoder.layers.1.") for name, _ in files)
    for name, ((p, kind, _),) in files:
        torch.testing.assert_close(kind.to_hf(ours[p]), hf_grads[name], rtol=1e-4,
                                   atol=max(1e-5 * hf_grads[name].abs().max().item(), 1e-8),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mesh, rules", [(fpp.Mesh(dp_shard=2), "fsdp"), (fpp.Mesh(tp=2), "tp")])
def test_fsdp_and_tp_equal_one_device(saved, mesh, rules):
    _, d, cfg = saved
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    rules = llama.default_rules(tp=rules == "tp", fsdp=rules == "fsdp")
    batch = batch_of(*rows(seed=2, dtype=torch.float64))
    loss0, grads0 = single_device(cfg, params, batch)
    for rank, (loss, grads, _) in enumerate(parallel(cfg, params, batch, mesh, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


def test_lora_on_axolotls_targets_equals_peft(saved):
    """The example config's ``lora_target_modules`` regex (the decoder's q / k / v) on rows with images:
    our loss and every adapter gradient of one step equal peft's on transformers' model."""
    _, d, cfg = saved
    regex = r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"
    model = transformers.Lfm2VlForConditionalGeneration.from_pretrained(d, dtype=torch.float64,
                                                                        attn_implementation="eager")
    pm = peft_lora(model, regex, seed=3)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=regex)
    decls = adapters.init(llama.init(cfg, torch.float64), lc, cfg.model_type)
    state = {k: v for k, v in pm.state_dict().items() if "lora_" in k}
    lora = {}
    for path, ab in adapters.split(decls)[1].items():
        module = "base_model.model." + llama_hf.module_renamed(path, cfg.model_type, cfg)[:-len(".weight")]
        lora[path] = {"lora_A": state[f"{module}.lora_A.default.weight"].T.reshape(ab["lora_A"].shape),
                      "lora_B": state[f"{module}.lora_B.default.weight"].T.reshape(ab["lora_B"].shape)}
    assert sorted(lora) == ["layers.1.self_attn.k_proj", "layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"]
    full = adapters.joined(hf.load_hf_params(d, cfg, dtype=torch.float64), lora)
    ids, pixels = rows(seed=5, dtype=torch.float64)
    dims = {"tokens": "batch seq", "labels": "batch seq", **IMAGE_DIMS}
    losses, grads, _ = train_adapters(cfg, lc, decls, full, [batch_of(ids, pixels)], fpp.Mesh(), fpp.Rules(),
                                      batch_dims=dims)[0]
    logits = pm(**hf_inputs(ids, pixels)).logits[:, :-1]
    ref = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels_of(ids).reshape(-1))
    ref.backward()
    torch.testing.assert_close(torch.tensor(losses[0], dtype=torch.float64), ref.detach(), rtol=1e-7, atol=0)
    want = {k: p.grad for k, p in pm.named_parameters() if p.requires_grad}
    assert len(want) == 6 and all(w.abs().max() > 0 for w in want.values())
    for path, ab in grads.items():
        module = "base_model.model." + llama_hf.module_renamed(path, cfg.model_type, cfg)[:-len(".weight")]
        for part in ("lora_A", "lora_B"):
            w = want[f"{module}.{part}.default.weight"]
            torch.testing.assert_close(ab[part].reshape(w.T.shape).T, w, rtol=1e-5, atol=1e-5 * w.abs().max().item(),
                                       msg=lambda m: f"{path} {part}: {m}")


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
    from safetensors.torch import load_file
    _, d, cfg = saved
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    params = tree.tree_map(lambda t: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype), params)
    out = hf.save_hf_llama(params, cfg, tmp_path / "out")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Lfm2VlForConditionalGeneration"] and raw["model_type"] == "lfm2_vl"
    assert dataclasses.replace(hf.config_from_hf(raw), vision=llama_hf.vision_from_hf(raw)) == cfg
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(d / "model.safetensors")))
    model = transformers.Lfm2VlForConditionalGeneration.from_pretrained(out, dtype=torch.float64,
                                                                        attn_implementation="eager").eval()
    ids, pixels = rows(seed=4, dtype=torch.float64)
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
    torch.testing.assert_close(our_logits(params, cfg, ids, pixels), want, rtol=1e-5, atol=5e-5)


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
        batch = batch_of(*rows())
        del batch["patch_taps"], batch["patch_tap_weights"]
        single_device(cfg, hf.load_hf_params(d, cfg, dtype=torch.float64), batch)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    _, _, cfg = saved
    data = [batch_of(*rows(seed=s, dtype=torch.float64)) for s in range(2)]
    dims = {"tokens": "batch seq", "labels": "batch seq", **IMAGE_DIMS}
    one = fpp.launch(train_steps(cfg, data, fpp.Mesh(), fpp.Rules(), batch_dims=dims), fpp.Mesh())[0]
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2)
    for losses, params, _ in fpp.launch(train_steps(cfg, data, mesh, llama.default_rules(tp=False), batch_dims=dims),
                                        mesh, processes=True, timeout=600):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=1e-10, atol=0)
        for p, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one[1][p]), rtol=1e-8, atol=1e-12,
                                       msg=lambda m: f"{p}: {m}")
    assert any(p.startswith("vision_tower.encoder.layers.") for p in one[1])


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
        named = sharding.named_tree(adapters.joined(hf.load_hf_params(d, cfg), lora), decls)
        images = {k: fpp.wrap(v, IMAGE_DIMS[k]) for k, v in entries(ids, pixels).items()}
        got = adapters.adapt(llama.forward, lc)(named, fpp.wrap(ids, "batch seq"), cfg, images=images).value()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        base = our_logits(hf.load_hf_params(d, cfg), cfg, ids, pixels)
    assert (base - want).abs().max() > 1e-3                          # (the adapters act)
    from safetensors.torch import load_file
    back = peft_dir.from_peft(load_file(str(out / peft_dir.WEIGHTS)), decls, "lfm2_vl")
    for p, ab in lora.items():
        for part in ("lora_A", "lora_B"):
            torch.testing.assert_close(back[p][part], ab[part], rtol=0, atol=0)
