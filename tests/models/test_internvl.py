"""InternVL (models/internvl.py: the InternViT tower, CLIP's layers with layer scales; the pixel-shuffle
projector of models/lfm2_vl.py; a Qwen decoder) equals transformers' ``InternVLForConditionalGeneration``
on a tiny random checkpoint: logits, fp64 loss and every gradient, LoRA on the decoder equal to
peft's; FSDP and TP on two simulated devices equal one device; export writes the multimodal class,
which transformers loads with our logits; bad inputs are refused by name."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from harness import parallel, peft_lora, single_device, train_adapters

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.data.images import IMAGE_DIMS, image_batch
from functional_pp.models import internvl_hf, llama, llama_hf
from functional_pp.parallel import sharding

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
    model.save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    return model, dataclasses.replace(hf.config_from_hf(raw), vision=llama_hf.vision_from_hf(raw))


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


def entries(ids, pixels):
    return image_batch(ids, pixels, [torch.tensor([[16, 16]] * n) if n else None for n in TILES], patch=4, merge=2,
                       image_token_id=IMAGE, class_token="dropped", image_size=16)


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
    assert (cfg.model_type, cfg.text_of, cfg.vision.tower, cfg.vision.merge) == ("qwen3", "internvl", "internvit", 2)
    params = hf.load_hf_params(d, cfg)
    ids, pixels = rows()
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
        text_only = llama.forward(sharding.named_tree(params, llama.init(cfg)), fpp.wrap(ids, "batch seq"),
                                  cfg).value()
    torch.testing.assert_close(our_logits(params, cfg, ids, pixels), want, atol=1e-5, rtol=1e-5)
    assert (text_only - want).abs().max() > 0.1          # the images matter


def test_an_earlier_layers_features_and_the_final_norm_equal_transformers(tmp_path):
    """``vision_feature_layer: -2`` (the layers after it not run, not declared) and ``use_mean_pooling: false``
    (a LayerNorm on the last hidden states, here unread)."""
    model, cfg = build(tmp_path, vision_feature_layer=-2, vision=dict(use_mean_pooling=False))
    assert cfg.vision.used_layers == 1 and cfg.vision.final_norm
    ids, pixels = rows(seed=3)
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
    torch.testing.assert_close(our_logits(hf.load_hf_params(tmp_path, cfg), cfg, ids, pixels), want, atol=1e-5,
                               rtol=1e-5)


def test_loss_and_every_gradient_equal_transformers(saved):
    _, d, cfg = saved
    model = transformers.InternVLForConditionalGeneration.from_pretrained(d, dtype=torch.float64,
                                                                          attn_implementation="eager")
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    ids, pixels = rows(seed=1, dtype=torch.float64)
    loss, grads = single_device(cfg, params, batch_of(ids, pixels))
    logits = model(**hf_inputs(ids, pixels)).logits[:, :-1]
    want = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels_of(ids).reshape(-1))
    want.backward()
    # (transformers' rotary tables are float32 whatever the dtype: float32's precision, not float64's)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)
    module = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
              "multi_modal_projector.": "model.multi_modal_projector.", "language_model.lm_head.": "lm_head."}
    hf_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ours = dict(tree.leaves_with_paths(grads))
    files = hf._file_tensors(llama.init(cfg), cfg)
    assert len(files) == len(hf_grads) and any(n == "vision_tower.embeddings.cls_token" for n, _ in files)
    for name, ((p, kind, _),) in files:
        key = next(name.replace(a, b, 1) for a, b in module.items() if name.startswith(a))
        torch.testing.assert_close(kind.to_hf(ours[p]), hf_grads[key], rtol=1e-5,
                                   atol=max(1e-6 * hf_grads[key].abs().max().item(), 1e-9),
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
    """The example config's ``lora_target_modules`` regex (the decoder's attention and MLP projections) on
    rows with images: our loss and every adapter gradient of one step equal peft's."""
    _, d, cfg = saved
    regex = r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"
    model = transformers.InternVLForConditionalGeneration.from_pretrained(d, dtype=torch.float64,
                                                                          attn_implementation="eager")
    pm = peft_lora(model, regex, seed=3)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=regex)
    decls = adapters.init(llama.init(cfg, torch.float64), lc, cfg.model_type)
    state = {k: v for k, v in pm.state_dict().items() if "lora_" in k}

    def module(path):         # (transformers 5's module names: the decoder under model.language_model.)
        return "base_model.model." + llama_hf.hf_name(path)[:-len(".weight")].replace("model.", "model.language_model.", 1)
    lora = {path: {"lora_A": state[f"{module(path)}.lora_A.default.weight"].T.reshape(ab["lora_A"].shape),
                   "lora_B": state[f"{module(path)}.lora_B.default.weight"].T.reshape(ab["lora_B"].shape)}
            for path, ab in adapters.split(decls)[1].items()}
    assert len(lora) == 2 * 7
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
    assert len(want) == 28 and all(w.abs().max() > 0 for w in want.values())
    for path, ab in grads.items():
        for part in ("lora_A", "lora_B"):
            w = want[f"{module(path)}.{part}.default.weight"]
            torch.testing.assert_close(ab[part].reshape(w.T.shape).T, w, rtol=1e-5, atol=1e-6 * w.abs().max().item(),
                                       msg=lambda m: f"{path} {part}: {m}")


def test_export_writes_the_multimodal_class(saved, tmp_path):
    from safetensors.torch import load_file
    _, d, cfg = saved
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    params = tree.tree_map(lambda t: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype), params)
    out = hf.save_hf_llama(params, cfg, tmp_path / "out")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["InternVLForConditionalGeneration"] and raw["model_type"] == "internvl"
    assert dataclasses.replace(hf.config_from_hf(raw), vision=llama_hf.vision_from_hf(raw)) == cfg
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(d / "model.safetensors")))
    model = transformers.InternVLForConditionalGeneration.from_pretrained(out, dtype=torch.float64,
                                                                          attn_implementation="eager").eval()
    ids, pixels = rows(seed=4, dtype=torch.float64)
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
    torch.testing.assert_close(our_logits(params, cfg, ids, pixels), want, rtol=1e-5, atol=5e-5)   # (float32 rotary)


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
