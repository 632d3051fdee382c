"""Merge-aware NVFP4 LoRA (Axolotl's ``nvfp4_merge_aware``): each adapted weight trains as
``Q(W + scale A B)``, the merged weight through NVFP4 and back (16-input blocks, fresh E4M3 block
scales, the base's fp32 per-tensor scale), the gradient straight through to A and B. The quantizer
equals torchao's ``nvfp4_quantize`` bit for bit; the forward equals the merged weights' (bit for bit
in the weights); A's and B's gradients equal a hand-written straight-through reference built on
torchao's ``NVFP4Tensor``; FSDP x TP and EP (simulated, and FSDP x TP on gloo processes) equal one
device."""
import dataclasses
import json

import pytest
import torch
from harness import make_batch
from safetensors.torch import load_file, save_file

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama
from functional_pp.parallel import sharding
from functional_pp.quant import fp4

nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

CFG = llama.Config.tiny(model_type="qwen3_moe", qk_norm=True, experts=4, experts_top_k=2, moe_mlp=32,
                        norm_topk_prob=True, hidden=32, mlp=64, layers=1)
LORA = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "o_proj", "gate", "up", "down"),
                           nvfp4_merge_aware=True)
BATCH = make_batch(CFG, batch=4, seq=8)


def test_the_quantizer_equals_torchao_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(24, 64, generator=g) * 3).to(dtype)
        x[0, :16], x[1, :3] = 0.0, -1e-4                    # an all-zero block; entries rounding to -0
        pts = nvfp4.per_tensor_amax_to_scale(x.abs().max().float())
        scales, codes = nvfp4.nvfp4_quantize(x.contiguous(), 16, pts)
        mine, my_scales = fp4.quantize_nvfp4(x, pts)
        assert torch.equal(mine, codes.view(torch.uint8)) and torch.equal(my_scales.view(torch.uint8),
                                                                          scales.view(torch.uint8)), dtype
        want = nvfp4.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts).dequantize(torch.float32)
        assert torch.equal(fp4.nvfp4_round_trip(x.float(), pts), want)
        assert torch.equal(fp4.dequantize_nvfp4(mine, my_scales, pts), want)
    per_row = torch.tensor([0.01, 0.002, 0.03]).repeat_interleave(8).reshape(24, 1)   # one scale per expert
    rows = torch.cat([nvfp4.NVFP4Tensor.to_nvfp4(x.float()[i:i + 8].contiguous(), per_tensor_scale=per_row[i, 0])
                      .dequantize(torch.float32) for i in (0, 8, 16)])
    assert torch.equal(fp4.nvfp4_round_trip(x.float(), per_row), rows)


def _setup():
    decls = adapters.init(llama.init(CFG), LORA)
    g = torch.Generator().manual_seed(3)
    flat = {p: (0.05 * torch.randn(x.data.shape, generator=g) if p.endswith("lora_B") else x.data)
            for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=0))}
    return decls, map_with_path(lambda p, d: flat[p], decls)


DECLS, FULL = _setup()


def _torchao_snap(w_eff: torch.Tensor, base: torch.Tensor, in_ndim: int, experts: bool,
                  stored: torch.Tensor | None = None) -> torch.Tensor:
    """The straight-through reference: ``w_eff`` through torchao's NVFP4 (Hugging Face's rows
    ``[out, in]``, one tensor per expert, the per-tensor scale ``stored`` or from ``base``'s
    largest magnitude) in the forward, the identity in backward."""
    def one(w, b, s):
        n_in = w.shape[:in_ndim].numel()
        rows = w.detach().reshape(n_in, -1).T.contiguous()
        pts = nvfp4.per_tensor_amax_to_scale(b.abs().max().float()) if s is None else s
        q = nvfp4.NVFP4Tensor.to_nvfp4(rows, per_tensor_scale=pts).dequantize(torch.float32)
        return q.T.reshape(w.shape)
    if experts:
        q = torch.stack([one(w, b, None if stored is None else stored[e])
                         for e, (w, b) in enumerate(zip(w_eff, base))])
    else:
        q = one(w_eff, base, stored)
    return w_eff + (q - w_eff).detach()


def _reference(params=None, stored=None):
    """Loss and the adapters' gradients of the model over hand-made ``Q(W + scale A B)`` weights
    (``params``: FULL; ``stored``: per-tensor scales by weight path, else from the base)."""
    full = map_with_path(lambda p, x: x.clone().requires_grad_() if ".lora." in p else x,
                         FULL if params is None else params)
    leaves = {p: x for p, x in tree.leaves_with_paths(full) if ".lora." in p}
    base, lora = adapters.split(full)
    lora = adapters.with_shared_a(lora, LORA)
    weights = {}
    for path, ab in lora.items():
        w = dict(tree.leaves_with_paths(base))[path]
        experts = ab["lora_A"].ndim + ab["lora_B"].ndim - 3 == w.ndim
        eff = w + adapters.lora.delta(ab["lora_A"], ab["lora_B"], LORA.scale, experts)
        weights[path] = _torchao_snap(eff, w, ab["lora_A"].ndim - 1 - int(experts), experts,
                                      None if stored is None else stored[path])
    snapped = map_with_path(lambda p, x: weights.get(p, x), base)
    loss = llama.loss(sharding.named_tree(snapped, llama.init(CFG)),
                      {k: fpp.named(v, "batch seq") for k, v in BATCH.items()}, CFG).value()
    loss.backward()
    return loss.detach(), {p: x.grad for p, x in leaves.items()}


def _adapted(mesh=None, rules=None, processes=False, stored=None, params=None):
    """Per device: the merge-aware loss and the adapters' gathered gradients (``params``: FULL;
    ``stored``: the per-tensor scales by weight path, else from the base)."""
    mesh, rules = mesh or fpp.Mesh(), rules or Rules()
    loss_fn = adapters.adapt(llama.loss, LORA, stored)
    params = FULL if params is None else params

    def device():
        with fpp.use_rules(rules):
            local = tree.tree_map(lambda t: t.clone().requires_grad_(),
                                  sharding.shard(params, DECLS, mesh, rules, fpp.current_rank()))
            loss = loss_fn(sharding.named_tree(local, DECLS), {k: fpp.named(v, "batch seq") for k, v in BATCH.items()},
                           CFG).value()
            loss.backward()
            grads = fpp.gather_tree(tree.tree_map(lambda t: t.grad, local), DECLS, rules)
        return loss.detach(), {p: g for p, g in fpp.leaves_with_paths(grads) if ".lora." in p}
    return fpp.launch(device, mesh, processes=processes, **({"timeout": 300} if processes else {}))


@pytest.fixture(scope="module")
def one_device():
    return _adapted()[0]


def test_the_forward_is_the_merged_weights_forward():
    """The forward computes ``Q(W + scale A B)``: ``adapters.merge`` (the merged export's weights)
    gives them bit for bit; they differ from plain LoRA's ``W + scale A B``."""
    merged = adapters.merge(FULL, LORA)
    plain = adapters.merge(FULL, dataclasses.replace(LORA, nvfp4_merge_aware=False))
    applied = adapters.apply(sharding.named_tree(FULL, DECLS), LORA)
    q, up = applied["layers"][0]["self_attn"]["q_proj"], applied["layers"][0]["mlp"]["up"]
    eye = fpp.named(torch.eye(CFG.hidden)[None], "batch seq hidden")      # (x = I: the weight itself, exactly)
    got = {"layers.0.self_attn.q_proj": q.__named_einsum__("batch seq hidden, hidden heads head_dim -> batch seq "
                                                           "heads head_dim", [eye, q], 1).value()[0],
           "layers.0.mlp.up": up.__named_weight__().value()}
    for path, w in got.items():
        want = dict(tree.leaves_with_paths(merged))[path]
        assert torch.equal(w, want), path
        assert not torch.equal(want, dict(tree.leaves_with_paths(plain))[path]), path
    toks = fpp.wrap(BATCH["tokens"], "batch seq")
    with torch.no_grad():
        adapted = adapters.adapt(llama.forward, LORA)(sharding.named_tree(FULL, DECLS), toks, CFG).value()
        want = llama.forward(sharding.named_tree(merged, llama.init(CFG)), toks, CFG).value()
    torch.testing.assert_close(adapted, want, rtol=0, atol=1e-6)


def test_gradients_are_straight_through(one_device):
    loss, grads = one_device
    want_loss, want = _reference()
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert set(grads) == set(want)
    for p, g in grads.items():
        torch.testing.assert_close(g, want[p], rtol=1e-4, atol=1e-6, msg=p)
        assert g.abs().max() > 0, p


LAYOUTS = {
    "fsdp_x_tp": (fpp.Mesh(dp_shard=2, tp=2), Rules(batch="dp_shard", hidden="dp_shard", heads="tp", kv_heads="tp",
                                                    mlp="tp", vocab="tp")),
    "ep_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2), Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard")),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_equal_one_device(one_device, layout):
    mesh, rules = LAYOUTS[layout]
    loss, grads = one_device
    for got_loss, got in _adapted(mesh, rules, processes=layout == "fsdp_x_tp"):
        torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
        for p, g in got.items():
            torch.testing.assert_close(g, grads[p], rtol=1e-4, atol=1e-6, msg=p)


def test_dora_is_refused_by_name():
    with pytest.raises(ValueError, match="nvfp4_merge_aware with DoRA"):
        adapters.LoraConfig(target_modules=("q_proj",), dora=True, nvfp4_merge_aware=True)


def _modelopt(tmp_path_factory, scales=None):
    """The base model of FULL as a ModelOpt NVFP4 checkpoint (every linear but the router quantized
    by torchao, one tensor per expert; ``scales``: Hugging Face name -> the per-tensor scale to
    quantize and store it with, else its own ``amax / (448 * 6)``), and the same model read back
    (dequantized)."""
    scales = scales or {}
    dense = hf.save_hf_llama(adapters.split(FULL)[0], CFG, tmp_path_factory.mktemp("dense"))
    sd = load_file(dense / "model.safetensors")
    quantized = dict(sd)
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        pts = scales.get(k, nvfp4.per_tensor_amax_to_scale(sd[k].abs().max()))
        t = nvfp4.NVFP4Tensor.to_nvfp4(sd[k], per_tensor_scale=pts)
        quantized.update({k: t.qdata.view(torch.uint8).contiguous(), f"{k}_scale": t.scale.contiguous(),
                          f"{k}_scale_2": t.per_tensor_scale.reshape(()).float(),
                          k.removesuffix(".weight") + ".input_scale": torch.tensor(0.01)})
    out = tmp_path_factory.mktemp("modelopt")
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((dense / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    (out / "config.json").write_text(json.dumps(conf))
    return out, hf.load_hf_llama(out)


@pytest.fixture(scope="module")
def modelopt_base(tmp_path_factory):
    return _modelopt(tmp_path_factory)


def test_the_nvfp4_merged_export_reads_back_to_the_trained_forward(modelopt_base, tmp_path):
    """Trained on the ModelOpt checkpoint, exported merged in its layout: the adapted weights as
    NVFP4 (torchao's ``NVFP4Tensor`` reads them as the weights training computed with), the others
    copied; read back, every weight equals the trained model's bit for bit and the logits the
    merge-aware forward's."""
    path, (cfg, base) = modelopt_base
    assert cfg == CFG
    full = adapters.joined(base, adapters.split(FULL)[1])
    out = hf.save_hf_llama(adapters.merge(full, LORA), cfg, tmp_path / "merged", base_model=path,
                           nvfp4=adapters.nvfp4_scales(full, LORA))
    files, source = load_file(out / "model.safetensors"), load_file(path / "model.safetensors")
    assert set(files) == set(source) and json.loads((out / "config.json").read_text())["quantization_config"][
        "quant_algo"] == "NVFP4"
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert files[q].dtype == torch.uint8 and not torch.equal(files[q], source[q])       # adapted: new codes
    assert all(torch.equal(files[k + s], source[k + s]) for s in ("", "_scale", "_scale_2"))   # not adapted: copied
    _, back = hf.load_hf_llama(out)
    trained = adapters.merge(full, LORA)
    for p, w in tree.leaves_with_paths(back):
        assert torch.equal(w, dict(tree.leaves_with_paths(trained))[p]), p
    ao = nvfp4.NVFP4Tensor(files[q], files[q + "_scale"], 16, torch.float32, per_tensor_scale=files[q + "_scale_2"])
    assert torch.equal(ao.dequantize(torch.float32).T.reshape(CFG.hidden, CFG.heads, -1),
                       dict(tree.leaves_with_paths(back))["layers.0.self_attn.q_proj"])
    toks = fpp.wrap(BATCH["tokens"], "batch seq")
    with torch.no_grad():
        want = adapters.adapt(llama.forward, LORA)(sharding.named_tree(full, DECLS), toks, CFG).value()
        got = llama.forward(sharding.named_tree(back, llama.init(CFG)), toks, CFG).value()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_an_adapted_weight_base_model_does_not_quantize_is_refused(modelopt_base, tmp_path):
    path, (cfg, base) = modelopt_base
    plain = tmp_path / "plain"
    plain.mkdir()
    sd = load_file(path / "model.safetensors")
    for s in ("_scale", "_scale_2"):
        del sd["model.layers.0.self_attn.o_proj.weight" + s]
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(CFG.hidden, CFG.hidden)
    save_file(sd, plain / "model.safetensors")
    (plain / "config.json").write_text((path / "config.json").read_text())
    full = adapters.joined(base, adapters.split(FULL)[1])
    with pytest.raises(ValueError, match=r"o_proj\.weight is adapted but base_model does not store it as an NVFP4"):
        hf.check_nvfp4_targets(plain, adapters.targets(llama.init(cfg), LORA))      # (before training)
    hf.check_nvfp4_targets(path, adapters.targets(llama.init(cfg), LORA))
    with pytest.raises(ValueError, match=r"o_proj\.weight \[32, 32\] is adapted but base_model does not store it as "
                                         r"an NVFP4 weight"):
        hf.save_hf_llama(adapters.merge(full, LORA), cfg, tmp_path / "m", base_model=plain,
                         nvfp4=adapters.nvfp4_scales(full, LORA))


@pytest.mark.parametrize("extra, message", [
    ({"adapter": "qlora", "load_in_4bit": True}, "nvfp4_merge_aware with adapter: qlora.*set adapter: lora"),
    ({"qat": {"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 16}},
     "nvfp4_merge_aware with qat"),
    ({"nvfp4_merge_aware_start_step": 0.1}, "nvfp4_merge_aware_start_step.*remove it"),
])
def test_the_config_key_and_its_refusals(extra, message):
    from functional_pp.config.train_config import TrainConfig
    d = {"adapter": "lora", "lora_target_modules": ["q_proj"], "nvfp4_merge_aware": True}
    assert TrainConfig.from_dict(d).lora_config().nvfp4_merge_aware
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict({**d, **extra})


def test_a_base_without_nvfp4_is_refused_by_the_config(tmp_path):
    from functional_pp.config.train_config import TrainConfig
    hf.save_hf_llama(adapters.split(FULL)[0], CFG, tmp_path)
    with pytest.raises(ValueError, match=r"nvfp4_merge_aware but .*config\.json has no ModelOpt NVFP4"):
        TrainConfig.from_dict({"adapter": "lora", "lora_target_modules": ["q_proj"], "nvfp4_merge_aware": True,
                               "base_model": str(tmp_path)})


def test_qwen3_next_as_axolotl_targets_it(tmp_path):
    """Axolotl's example (qwen3-next-80b-a3b-nvfp4-lora.yaml: q/k/v/o and the experts' gate_up_proj /
    down_proj) on a tiny Qwen3-Next made by transformers, written as a ModelOpt checkpoint (one tensor
    per expert): its NVFP4 merged export reads back to the trained weights bit for bit and the
    merge-aware forward's logits."""
    transformers = pytest.importorskip("transformers")
    from axolotl_corpus import _modelopt_nvfp4

    from functional_pp.adapters.target_parameters import expert_targets
    torch.manual_seed(0)
    conf = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=64)
    transformers.Qwen3NextForCausalLM(conf).save_pretrained(tmp_path / "dense")
    (tmp_path / "nvfp4").mkdir()
    _modelopt_nvfp4(tmp_path / "dense", tmp_path / "nvfp4")
    cfg, base = hf.load_hf_llama(tmp_path / "nvfp4")
    experts, shared = expert_targets(["experts.gate_up_proj", "experts.down_proj"])
    lora = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj") + experts,
                               shared_a=shared, nvfp4_merge_aware=True)
    decls = adapters.init(llama.init(cfg), lora)
    g = torch.Generator().manual_seed(1)
    ab = {p: (0.05 * torch.randn(x.data.shape, generator=g) if p.endswith("lora_B") else x.data)
          for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=0)) if ".lora." in p}
    full = adapters.joined(base, adapters.split(map_with_path(lambda p, d: ab.get(p), decls))[1])
    out = hf.save_hf_llama(adapters.merge(full, lora), cfg, tmp_path / "merged", base_model=tmp_path / "nvfp4",
                           nvfp4=adapters.nvfp4_scales(full, lora))
    assert load_file(out / "model.safetensors")["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == torch.uint8
    _, back = hf.load_hf_llama(out)
    trained = dict(tree.leaves_with_paths(adapters.merge(full, lora)))
    for p, w in tree.leaves_with_paths(back):
        assert torch.equal(w, trained[p]), p
    with pytest.raises(ValueError, match=r"in_proj_q is a part of the fused tensor .*in_proj_qkvz"):
        hf.check_nvfp4_targets(tmp_path / "nvfp4", ["layers.0.linear_attn.in_proj_q"])
    toks = fpp.wrap(torch.randint(0, cfg.vocab, (2, 12), generator=g), "batch seq")
    with torch.no_grad():
        want = adapters.adapt(llama.forward, lora)(sharding.named_tree(full, decls), toks, cfg).value()
        got = llama.forward(sharding.named_tree(back, llama.init(cfg)), toks, cfg).value()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def modelopt_stored(tmp_path_factory):
    """FULL's base as a ModelOpt NVFP4 checkpoint whose adapted weights were quantized with (and
    store) per-tensor scales 1.25 times their own ``amax / (448 * 6)`` (a calibrated amax, as
    ModelOpt's): ``(path, (cfg, base read back), FULL's adapters on that base, the stored scales
    read by weight path, one device's loss and adapter gradients with them)``."""
    own = adapters.nvfp4_scales(FULL, LORA)
    path, (cfg, base) = _modelopt(tmp_path_factory, hf.nvfp4_names(CFG, {p: s * 1.25 for p, s in own.items()}))
    full = adapters.joined(base, adapters.split(FULL)[1])
    stored = hf.nvfp4_stored_scales(path, adapters.targets(llama.init(cfg), LORA))
    return path, (cfg, base), full, stored, _adapted(stored=stored, params=full)[0]


def test_the_stored_per_tensor_scale_is_the_one_trained_with(modelopt_stored):
    """Axolotl snaps with the checkpoint's stored ``weight_scale_2``: read by weight path (one per
    expert for the experts), the loss and A's and B's gradients equal the straight-through
    reference on torchao's ``NVFP4Tensor`` with those scales, not with the scales recomputed from
    the dequantized base (which differ)."""
    path, _, full, stored, (loss, grads) = modelopt_stored
    files = load_file(path / "model.safetensors")
    assert torch.equal(stored["layers.0.self_attn.q_proj"], files["model.layers.0.self_attn.q_proj.weight_scale_2"])
    assert stored["layers.0.mlp.up"].shape == (CFG.experts,)
    assert torch.equal(stored["layers.0.mlp.up"][3], files["model.layers.0.mlp.experts.3.up_proj.weight_scale_2"])
    computed = adapters.nvfp4_scales(full, LORA)
    assert all(not torch.equal(stored[p], computed[p]) for p in stored)
    want_loss, want = _reference(full, stored)
    recomputed_loss, recomputed = _reference(full)
    assert (recomputed_loss - want_loss).abs() > 1e-4 * want_loss        # (the test tells the two apart)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for p, g in grads.items():
        torch.testing.assert_close(g, want[p], rtol=1e-4, atol=1e-6, msg=p)


def test_a_run_on_a_modelopt_base_trains_with_its_stored_scales(modelopt_stored):
    """The train command's loss (app.inputs.frozen_and_adapters with base_model) is the loss with
    base_model's stored scales (the straight-through reference's)."""
    from functional_pp.app.inputs import frozen_and_adapters
    from functional_pp.config.train_config import TrainConfig
    path, (cfg, _), full, stored, _ = modelopt_stored
    run = TrainConfig.from_dict({"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "nvfp4_merge_aware": True,
                                 "lora_target_modules": list(LORA.target_modules), "base_model": str(path)})
    loss_fn, decls, _ = frozen_and_adapters(run, run.lora_config(), llama.loss, llama.init(cfg))
    with torch.no_grad():
        got = loss_fn(sharding.named_tree(full, DECLS), {k: fpp.named(v, "batch seq") for k, v in BATCH.items()},
                      cfg).value()
    torch.testing.assert_close(got, _reference(full, stored)[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stored_scales_layouts_equal_one_device(modelopt_stored, layout):
    """The stored scales (replicated, one per expert taken by each device's experts) under FSDP x TP
    (gloo processes) and EP x FSDP equal one device."""
    mesh, rules = LAYOUTS[layout]
    *_, full, stored, (loss, grads) = modelopt_stored
    for got_loss, got in _adapted(mesh, rules, processes=layout == "fsdp_x_tp", stored=stored, params=full):
        torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
        for p, g in got.items():
            torch.testing.assert_close(g, grads[p], rtol=1e-4, atol=1e-6, msg=p)


def test_the_merged_export_writes_the_stored_scales(modelopt_stored, tmp_path):
    """Exported merged with the stored scales: each adapted weight's ``weight_scale_2`` is
    base_model's, bit for bit; read back, the weights are the trained ``Q(W + s A B)`` and the
    logits the merge-aware forward's."""
    path, (cfg, _), full, stored, _ = modelopt_stored
    out = hf.save_hf_llama(adapters.merge(full, LORA, stored), cfg, tmp_path / "merged", base_model=path,
                           nvfp4=stored)
    files, source = load_file(out / "model.safetensors"), load_file(path / "model.safetensors")
    for k in [k for k in source if k.endswith("_scale_2")]:
        assert torch.equal(files[k], source[k]), k
    _, back = hf.load_hf_llama(out)
    trained = dict(tree.leaves_with_paths(adapters.merge(full, LORA, stored)))
    for p, w in tree.leaves_with_paths(back):
        assert torch.equal(w, trained[p]), p
    toks = fpp.wrap(BATCH["tokens"], "batch seq")
    with torch.no_grad():
        want = adapters.adapt(llama.forward, LORA, stored)(sharding.named_tree(full, DECLS), toks, CFG).value()
        got = llama.forward(sharding.named_tree(back, llama.init(CFG)), toks, CFG).value()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_stored_scale_missing_or_misshapen_is_refused(modelopt_stored):
    *_, full, stored, _ = modelopt_stored
    params = sharding.named_tree(full, DECLS)
    with pytest.raises(ValueError, match=r"no stored per-tensor scale for the adapted weight layers\.0\.mlp\.up"):
        adapters.apply(params, LORA, {p: s for p, s in stored.items() if p != "layers.0.mlp.up"})
    with pytest.raises(ValueError, match=r"scale of layers\.0\.mlp\.up has shape \(\), expected \(4,\)"):
        adapters.apply(params, LORA, {**stored, "layers.0.mlp.up": stored["layers.0.mlp.up"][0]})
