"""Gemma 4 unified (``gemma4_unified``, Gemma 4 12B: no vision encoder, models/gemma4_unified.py's
embedder; an image's tokens attending to each other, ops.attention's ``groups``) equals transformers'
``Gemma4UnifiedForConditionalGeneration`` on a tiny random checkpoint with rows of 0, 1 and 2 images:
logits, fp64 loss and every gradient; LoRA with Axolotl's regex equals peft's; FSDP, TP and CP (packed
rows too) on simulated devices and DP x FSDP on real gloo processes equal one device; export writes
the unified class, which transformers loads with our logits."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from harness import parallel, peft_lora, single_device, train_steps

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.data.images import IMAGE_DIMS, image_batch
from functional_pp.models import gemma4_hf, gemma4_unified_hf, llama, llama_hf
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4UnifiedForConditionalGeneration"):
    pytest.skip("transformers without Gemma 4 unified", allow_module_level=True)

IMAGE, BOI, EOI = 250, 251, 252
TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=4, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=None,
            eos_token_id=None, max_position_embeddings=128)
VISION = dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=16, mm_posemb_size=8, output_proj_dims=16)
P, K = 4, 2                                                    # patch side, pooling kernel
GRIDS = [[(4, 6), (2, 2)], [(2, 4)], [], [(6, 2)]]             # per row: its images' (rows, columns) of patches


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    conf = transformers.Gemma4UnifiedConfig(text_config=TEXT, vision_config=VISION, audio_config=None,
                                            image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI,
                                            video_token_id=253, audio_token_id=254, boa_token_id=255,
                                            eoa_token_index=249)
    model = transformers.Gemma4UnifiedForConditionalGeneration(conf).float().eval()
    with torch.no_grad():                       # O(1) logits; norms and position tables off their initial values
        for n, p in model.named_parameters():
            if "q_norm" in n or "k_norm" in n:
                p.copy_(0.4 + 0.05 * torch.randn_like(p))
            elif "norm" in n or "_ln" in n:
                p.copy_((0 if n.endswith("bias") else 1) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(0.6 + 0.2 * torch.rand_like(b))
    d = tmp_path_factory.mktemp("gemma4_unified")
    model.save_pretrained(d, safe_serialization=True)
    raw = json.loads((d / "config.json").read_text())
    cfg = dataclasses.replace(hf.config_from_hf(raw), vision=llama_hf.vision_from_hf(raw))
    return model, d, cfg


def rows(seed=0, seq=16, dtype=torch.float32):
    """Token rows with each row's image tokens (one per 2 x 2 patches, between begin / end of image
    tokens; row 0's first image longer than the sliding window) and its images' pixels (C, H, W in [0, 1])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 240, (len(GRIDS), seq), generator=g)
    ids[0, 1], ids[0, 2:8], ids[0, 8], ids[0, 10], ids[0, 11], ids[0, 12] = BOI, IMAGE, EOI, BOI, IMAGE, EOI
    ids[1, 4], ids[1, 5:7], ids[1, 7] = BOI, IMAGE, EOI
    ids[3, 8], ids[3, 9:12], ids[3, 12] = BOI, IMAGE, EOI
    pixels = [[torch.rand(3, h * P, w * P, generator=g, dtype=dtype) for h, w in gr] for gr in GRIDS]
    return ids, pixels


def hf_inputs(ids, pixels):
    """transformers' inputs as Gemma 4 unified's image processor makes them: each image's model patches
    (``K * P`` pixels a side, row by row, each as (y, x, channel) pixels: ``patches_merge``'s order) and
    their (x, y) positions, padded to the most with positions -1; the image tokens' type 1."""
    images = [im for row in pixels for im in row]
    S = K * P
    most = max(im.shape[1] * im.shape[2] // S ** 2 for im in images)
    values, positions = [], []
    for im in images:
        c, h, w = im.shape
        patches = im.reshape(c, h // S, S, w // S, S).permute(1, 3, 2, 4, 0).reshape(-1, S * S * c)
        y, x = torch.meshgrid(torch.arange(h // S), torch.arange(w // S), indexing="ij")
        pos = torch.stack([x.reshape(-1), y.reshape(-1)], -1)
        pad = most - len(patches)
        values.append(torch.cat([patches, patches.new_zeros(pad, patches.shape[1])]))
        positions.append(torch.cat([pos, torch.full((pad, 2), -1)]))
    return dict(input_ids=ids, pixel_values=torch.stack(values), image_position_ids=torch.stack(positions),
                mm_token_type_ids=(ids == IMAGE).int())


def entries(ids, pixels):
    sizes = [torch.tensor([im.shape[1:] for im in row]) if row else None for row in pixels]
    padded = [_pad(row) if row else None for row in pixels]
    return image_batch(ids, padded, sizes, patch=P, merge=K, image_token_id=IMAGE, groups=True)


def _pad(images):
    h, w = max(im.shape[1] for im in images), max(im.shape[2] for im in images)
    return torch.stack([F.pad(im, (0, w - im.shape[2], 0, h - im.shape[1])) for im in images])


def labels_of(ids):
    lab = ids[:, 1:].clone()
    lab[lab == IMAGE] = -100
    return lab


def batch_of(ids, pixels):
    b = {k: v[:, :-1] if k in ("image_slots", "image_groups") else v for k, v in entries(ids, pixels).items()}
    return {"tokens": ids[:, :-1], "labels": labels_of(ids), **b}


def our_logits(params, cfg, ids, pixels, dtype=torch.float32):
    named = sharding.named_tree(params, llama.init(cfg, dtype))
    images = {k: fpp.wrap(v, IMAGE_DIMS[k]) for k, v in entries(ids, pixels).items()}
    return llama.forward(named, fpp.wrap(ids, "batch seq"), cfg, images=images).value()


def test_config_reads_the_embedder_and_the_bidirectional_mask(saved):
    _, _, cfg = saved
    v = cfg.vision
    assert (cfg.model_type, v.tower, v.patch_size, v.pool, v.embed, v.positions) == (
        "gemma4_unified", "gemma4_unified", 4, 2, 16, 8)
    assert (v.image_token_id, v.boi_token_id, v.eoi_token_id) == (IMAGE, BOI, EOI)
    assert cfg.image_groups_attend and cfg.per_layer_input == 0 and cfg.sliding_window == 4


def test_logits_equal_transformers(saved):
    model, d, cfg = saved
    params = hf.load_hf_params(d, cfg)
    ids, pixels = rows()
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
        got = our_logits(params, cfg, ids, pixels)
        causal = our_logits(params, dataclasses.replace(cfg, image_groups_attend=False), ids, pixels)
        named = sharding.named_tree(params, llama.init(cfg))
        text_only = llama.forward(named, fpp.wrap(ids, "batch seq"), cfg).value()
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    assert (causal - want).abs().max() > 1e-2            # the image tokens' bidirectional attention matters
    assert (text_only - want).abs().max() > 0.1          # the images matter
    torch.testing.assert_close(text_only[2], want[2], atol=1e-5, rtol=1e-5)     # (row 2: no image)


def test_loss_and_every_gradient_equal_transformers(saved):
    _, d, cfg = saved
    model = transformers.Gemma4UnifiedForConditionalGeneration.from_pretrained(d, dtype=torch.float64,
                                                                               attn_implementation="eager")
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    ids, pixels = rows(seed=1, dtype=torch.float64)
    loss, grads = single_device(cfg, params, batch_of(ids, pixels))
    logits = model(**hf_inputs(ids, pixels)).logits[:, :-1]
    want = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels_of(ids).reshape(-1))
    want.backward()
    # (transformers' RMSNorms run in float32 whatever the dtype: float32's precision)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    hf_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ours = dict(tree.leaves_with_paths(grads))
    files = hf._file_tensors(llama.init(cfg), cfg)
    names = {name for name, _ in files}
    assert {"model.vision_embedder.patch_dense.bias", "model.vision_embedder.pos_embedding",
            "model.embed_vision.embedding_projection.weight"} <= names           # (the files' names)
    seen = 0
    for name, parts in files:
        if name.endswith("layer_scalar"):            # (a constant of the files: no gradient, ours zero)
            assert torch.equal(ours[parts[0][0]], torch.zeros((), dtype=torch.float64))
            continue
        got = torch.cat([kind.to_hf(ours[p]) for p, kind, _ in parts])
        want_g = hf_grads[llama_hf.module_renamed(parts[0][0], cfg.model_type, cfg)]     # (its module's name)
        torch.testing.assert_close(got, want_g, rtol=1e-4, atol=max(1e-5 * want_g.abs().max().item(), 1e-9),
                                   msg=lambda m: f"{name}: {m}")
        seen += 1
    assert seen == len(hf_grads)


AXOLOTL_TARGETS = (r"model.language_model.layers.[\d]+.(_checkpoint_wrapped_module.)?(mlp|self_attn)."
                   r"(up|down|gate|q|k|v|o)_proj")
"""The example's lora_target_modules (gemma4-unified/12b-vision-lora.yaml): the text decoder's linears."""


def test_lora_with_the_examples_regex_equals_peft(saved):
    """LoRA with the example's regex, a batch with images: the loss and every adapter gradient of one
    step equal peft's on transformers' unified model (float64)."""

    from functional_pp import adapters
    from functional_pp.adapters import peft_dir
    from harness import train_adapters
    _, d, cfg = saved
    model = transformers.Gemma4UnifiedForConditionalGeneration.from_pretrained(d, dtype=torch.float64,
                                                                               attn_implementation="eager")
    pm = peft_lora(model, AXOLOTL_TARGETS, seed=5)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=AXOLOTL_TARGETS)
    decls = adapters.init(llama.init(cfg, torch.float64), lc)
    state = {k.replace(".default", ""): v.detach().clone() for k, v in pm.state_dict().items() if "lora_" in k}
    full = adapters.joined(hf.load_hf_params(d, cfg, dtype=torch.float64),
                           peft_dir.from_peft(state, decls, cfg.model_type))
    ids, pixels = rows(seed=6, dtype=torch.float64)
    ours = train_adapters(cfg, lc, decls, full, [batch_of(ids, pixels)], fpp.Mesh(), fpp.Rules(),
                          batch_dims={"tokens": "batch seq", "labels": "batch seq", **IMAGE_DIMS})[0]
    logits = pm(**hf_inputs(ids, pixels)).logits[:, :-1]
    ref = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels_of(ids).reshape(-1))
    ref.backward()
    torch.testing.assert_close(torch.tensor(float(ours[0][0]), dtype=torch.float64), ref.detach(), rtol=1e-6, atol=0)
    grads = peft_dir.to_peft(ours[1], cfg.model_type)
    want = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if p.requires_grad}
    assert grads.keys() == want.keys() and len(want) == 2 * 7 * cfg.layers
    for k in want:
        assert want[k].abs().max() > 0, k
        # (float32's precision where transformers' RMSNorms run in float32)
        torch.testing.assert_close(grads[k], want[k], rtol=1e-4, atol=1e-5 * want[k].abs().max().item(),
                                   msg=lambda m: f"grad {k}: {m}")


def _with_documents(batch):
    """The batch as packed rows: each row two documents (split at token 9: row 0's second image and
    row 3's image in the second), ``segments`` their ids."""
    seg = torch.zeros_like(batch["tokens"])
    seg[:, 9:] = 1
    return {**batch, "segments": seg}


@pytest.mark.parametrize("layout", ["fsdp", "tp", "cp", "cp_packed"])
def test_layouts_equal_one_device(saved, layout):
    _, d, cfg = saved
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    ids, pixels = rows(seed=2, seq=17, dtype=torch.float64)          # (16 tokens: load-balanced over cp 2)
    batch = batch_of(ids, pixels)
    if layout == "cp_packed":
        batch = _with_documents(batch)
    mesh = {"fsdp": fpp.Mesh(dp_shard=2), "tp": fpp.Mesh(tp=2)}.get(layout, fpp.Mesh(cp=2))
    rules = llama.default_rules(tp=layout == "tp", fsdp=layout == "fsdp")
    loss0, grads0 = single_device(cfg, params, batch)
    if layout == "cp_packed":            # (the documents cut an image's group from the text before it)
        causal = single_device(dataclasses.replace(cfg, image_groups_attend=False), params, batch)[0]
        assert (causal - loss0).abs() > 1e-4
    for rank, (loss, grads, _) in enumerate(parallel(cfg, params, batch, mesh, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


def test_export_writes_the_unified_class(saved, tmp_path):
    """Parameters moved off the checkpoint's values, exported: ``Gemma4UnifiedForConditionalGeneration``'s
    config, reading back as ours; the checkpoint's tensor names; transformers loads them with our
    logits on rows with images (float64)."""
    from safetensors.torch import load_file
    _, d, cfg = saved
    params = hf.load_hf_params(d, cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    params = tree.tree_map(lambda t: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype), params)
    out = tmp_path / "out"
    hf.save_hf_llama(params, cfg, out)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Gemma4UnifiedForConditionalGeneration"] and raw["model_type"] == "gemma4_unified"
    assert raw["text_config"]["use_bidirectional_attention"] == "vision"
    assert dataclasses.replace(hf.config_from_hf(raw), vision=llama_hf.vision_from_hf(raw)) == cfg
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(d / "model.safetensors")))
    model = transformers.Gemma4UnifiedForConditionalGeneration.from_pretrained(out, dtype=torch.float64,
                                                                               attn_implementation="eager").eval()
    ids, pixels = rows(seed=4, dtype=torch.float64)
    with torch.no_grad():
        want = model(**hf_inputs(ids, pixels)).logits
        got = our_logits(params, cfg, ids, pixels, torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)


def test_bad_inputs_are_refused_by_name(saved):
    _, d, cfg = saved
    raw = json.loads((d / "config.json").read_text())
    with pytest.raises(ValueError, match="use_bidirectional_attention='all' is not supported"):
        gemma4_hf.config_from_hf({**raw, "text_config": {**raw["text_config"], "use_bidirectional_attention": "all"}},
                                 "gemma4_unified")
    with pytest.raises(ValueError, match="output_proj_dims=8 differs from mm_embed_dim=16"):
        gemma4_unified_hf.vision_from_hf({**raw, "vision_config": {**raw["vision_config"], "output_proj_dims": 8}})
    batch = {k: v for k, v in batch_of(*rows()).items() if k != "image_groups"}
    with pytest.raises(ValueError, match="image_groups_attend .* needs the batch's image_groups"):
        single_device(cfg, hf.load_hf_params(d, cfg, dtype=torch.float64), batch)


def test_dp_fsdp_on_real_processes_equal_one_device(saved):
    """Two AdamW steps with images on DP x FSDP over four gloo processes equal one device."""
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
    assert any(p.startswith("multi_modal_projector.patch_dense") for p in one[1])
