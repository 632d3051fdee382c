"""Kimi Linear (``kimi_linear``: ``KimiLinearForCausalLM``) as a configuration of the one decoder
(models/kimi_delta.py, models/kimi_linear_hf.py): Kimi Delta Attention layers (the gated delta rule
with a decay per key channel) beside latent attention layers without rotary, DeepSeek-V3's experts
after a dense first layer. A tiny random model transformers builds from a config loads through the
HF import (the published checkpoint's names); logits, loss and every gradient equal transformers';
export writes ``KimiLinearForCausalLM``, which loads with equal logits; packed documents each equal
transformers on that document alone; LoRA on Axolotl's targets equals peft; FSDP x TP with sequence
parallelism and the experts over ep on simulated devices, FSDP x TP on real gloo processes, equal one
device; 8-bit / NF4 bases equal bitsandbytes; CP and the k/v cache are refused by name."""
import copy
import dataclasses
import json

import pytest
import torch
from harness import (assert_export_round_trip, assert_hf_layout_equals_one_device, assert_lora_step_equals_peft,
                     assert_packed_documents_equal_hf, assert_processes_equal_one_device, fp64_beside_hf,
                     import_logits_beside_hf, make_batch, our_logits, parallel, single_device, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "KimiLinearForCausalLM"):
    pytest.skip("transformers without Kimi Linear", allow_module_level=True)

# a delta-attention layer, a latent-attention layer, a delta-attention layer; a dense first MLP, then experts
# (4 in 2 groups, the best group chosen, 2 per token, a shared expert)
CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
              qk_nope_head_dim=8, v_head_dim=6, n_group=2, topk_group=1, num_experts_per_tok=2, num_local_experts=4,
              n_shared_experts=1, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"], initializer_range=0.2, routed_scaling_factor=1.5,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=128)
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


def _as_published(d) -> None:
    """The dense layers' MLP under ``mlp.`` as in the published checkpoint (transformers' save writes
    every layer's under ``block_sparse_moe.``; it reads either)."""
    from safetensors.torch import load_file, save_file
    f = d / "model.safetensors"
    files = load_file(str(f))
    save_file({k.replace("block_sparse_moe.", "mlp.") if ".experts." not in k and ".gate." not in k
               and "shared_experts" not in k else k: v for k, v in files.items()}, str(f), metadata={"format": "pt"})


def _build(conf, seed=0):
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**conf)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:        # (so that the correction changes the choice)
                b.copy_(0.1 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _build(CONFIG)
    d = tmp_path_factory.mktemp("kimi_linear")
    model.save_pretrained(d, safe_serialization=True)
    _as_published(d)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    return model, d


def test_config_reads_kimi_linear(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.layer_types, cfg.nope_layers, cfg.moe_layers) == (
        "kimi_linear", ("kimi_delta_attention", "full_attention", "kimi_delta_attention"), (0, 1, 2), (1, 2))
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        16, None, 8, 4, 6)
    assert (cfg.experts, cfg.experts_top_k, cfg.moe_mlp, cfg.shared_expert_mlp, cfg.router_groups,
            cfg.router_topk_groups, cfg.routed_scaling_factor, cfg.router_score, cfg.router_bias) == (
        4, 2, 16, 16, 2, 1, 1.5, "sigmoid", True)
    assert (cfg.linear_heads, cfg.linear_head_dim, cfg.linear_conv_kernel) == (4, 8, 4)
    decls = dict(tree.leaves_with_paths(llama.init(cfg)))
    assert decls["layers.0.kda.dt_bias"].shape == (4, 8) and decls["layers.0.kda.f_b_proj"].shape == (8, 4, 8)
    # the checkpoint's own spelling (linear_attn_config, attribute_map names, first_k_dense_replace)
    conf = {k: v for k, v in json.loads((saved[1] / "config.json").read_text()).items()
            if k not in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads",
                         "linear_conv_kernel_dim")}
    conf.update(linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 8, "num_heads": 4,
                                    "short_conv_kernel_size": 4}, first_k_dense_replace=1)
    assert hf.config_from_hf(conf) == cfg


def test_import_logits_equal_transformers(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved, atol=3e-5)
    for change in (dict(routed_scaling_factor=1.0), dict(norm_eps=1e-2), dict(nope_layers=None, rope_scaling=None)):
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change
    no_bias = copy.deepcopy(params)                              # (the score correction changes the choice)
    for i in (1, 2):
        no_bias["layers"][i]["mlp"]["router_bias"] = torch.zeros(4)
    assert not torch.allclose(our_logits(no_bias, cfg, toks), want, atol=1e-3)


def test_loss_and_gradients_equal_transformers(saved):
    """float64 (transformers computes the delta rule and the gated norm in float32: equal to its precision)."""
    _, d = saved
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    fused = hf.save_hf_llama(grads, cfg, d.parent / "grads")
    from safetensors.torch import load_file
    files = load_file(str(fused / "model.safetensors"))
    assert dict(tree.leaves_with_paths(grads))["layers.0.kda.A_log"].abs().max() > 0
    renames = (("mlp.shared_experts.", "block_sparse_moe.shared_experts."), ("self_attn.forget_gate.", "self_attn."),
               ("mlp.gate.", "block_sparse_moe.gate."))
    for name, g in ((n, p.grad) for n, p in model.named_parameters()):
        file = name
        for a, b in renames:
            file = file.replace(a, b)
        if name.endswith("experts.gate_up_proj"):    # (transformers holds the experts fused: gate_up_proj [E, 2F, H])
            pre = file.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.")
            ours = torch.stack([torch.cat([files[f"{pre}{j}.{w}.weight"] for w in ("w1", "w3")]) for j in range(4)])
        elif name.endswith("experts.down_proj"):
            pre = file.replace("mlp.experts.down_proj", "block_sparse_moe.experts.")
            ours = torch.stack([files[f"{pre}{j}.w2.weight"] for j in range(4)])
        elif name.endswith("self_attn.conv1d.weight"):
            ours = torch.cat([files[file.replace("conv1d", f"{x}_conv1d")] for x in "qkv"])
        else:
            ours = files[file]
        assert g.abs().max() > 0 or name.endswith("gate.weight"), name
        g = g.to(ours.dtype)                          # (transformers keeps dt_bias and the router in float32)
        torch.testing.assert_close(ours.reshape(g.shape), g, rtol=1e-3, atol=1e-4 * g.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "kimi_linear", "KimiLinearForCausalLM", atol=5e-5, **EAGER)


def test_lora_on_axolotls_targets_equals_peft(saved):
    """Axolotl's Kimi Linear targets: q/k/v/o of the delta attention, q/o of the latent attention, the
    dense MLP's and the shared experts' gate/up/down (the routed experts are no Linear modules)."""
    model = transformers.KimiLinearForCausalLM.from_pretrained(saved[1], dtype=torch.float32, **EAGER)
    assert_lora_step_equals_peft(model, saved[1], ["gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj",
                                                   "o_proj"], count=2 * (7 + 5 + 7))


def test_packed_documents_equal_transformers_on_each(saved):
    """Packed rows (``segments``, Axolotl's sample_packing): each document's logits equal transformers'
    logits of that document alone (the convolutions and the recurrence restart, attention stays inside)."""
    assert_packed_documents_equal_hf(*saved)


def test_layouts_equal_one_device(saved):
    """FSDP x TP with sequence parallelism (the delta attention's heads, its convolutions' channels and
    per-channel decays over tp; packed rows), and the experts over ep (FSDP 2 x EP 2)."""
    assert_hf_layout_equals_one_device(saved[1], "fsdp_tp_sp")
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    batch["segments"] = torch.tensor([[0] * 5 + [1] * 7, [2] * 12, [3] * 3 + [4] * 9, [5] * 8 + [6] * 4])
    loss, grads = single_device(cfg, params, batch)
    for mesh, rules in ((fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True)),
                        (fpp.Mesh(dp_shard=2, ep=2), fpp.Rules(batch=("dp_shard", "ep"), experts="ep",
                                                               hidden="dp_shard"))):
        p_loss, p_grads, _ = parallel(cfg, params, batch, mesh, rules)[0]
        torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
        for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def test_fsdp_tp_on_real_processes_equal_one_device(saved):
    assert_processes_equal_one_device(hf.config_from_hf(saved[1]))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_base_equals_transformers_with_bitsandbytes(kind, tmp_path):
    """QLoRA's base (``load_in_4bit``, NF4) and Axolotl's ``load_in_8bit``: every linear of the delta
    attention, the latent attention, the dense MLP and the shared experts quantized as transformers +
    bitsandbytes quantize them (transformers' own save, its dense MLP under ``block_sparse_moe``) gives
    the same logits. Sizes hold whole blocks of 64."""
    pytest.importorskip("bitsandbytes")
    from harness import assert_nf4_base_equals_bitsandbytes
    conf = dict(CONFIG, hidden_size=128, intermediate_size=128, moe_intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=2, kv_lora_rank=64, qk_nope_head_dim=60, qk_rope_head_dim=4, v_head_dim=64,
                linear_num_heads=2, linear_head_dim=64, initializer_range=0.1)
    model = _build(conf, seed=1)
    if kind == "nf4":
        qp = assert_nf4_base_equals_bitsandbytes(model, tmp_path, **EAGER)
    else:
        qp = _assert_int8_base_equals_bitsandbytes(model, tmp_path)
    assert type(qp["layers"][0]["kda"]["q_proj"]).__name__ == "QuantizedWeight"
    assert type(qp["layers"][1]["self_attn"]["kv_b_proj"]).__name__ == "QuantizedWeight"


def _assert_int8_base_equals_bitsandbytes(model, out_dir) -> dict:
    """``load_in_8bit``'s base (blockwise absmax int8, blocks of 64; docs/quantization.md): our logits of
    the int8 weights equal transformers' with those weights dequantized (bitsandbytes' LLM.int8() is
    another scheme); the quantization acts. Returns our quantized parameters."""
    from functional_pp.models.quantize import block_dim, quantize_linear_weights
    from functional_pp.parallel import sharding
    from functional_pp.quant.weights import QuantizedWeight, dequantize
    model.save_pretrained(out_dir / "full")
    cfg, params = hf.load_hf_llama(out_dir / "full")
    decls = llama.init(cfg)
    qp, qd = quantize_linear_weights(params, decls, "int8")
    with torch.no_grad():
        got = llama.forward(sharding.named_tree(qp, qd), fpp.wrap(tokens(), "batch seq"), cfg).value()
        full = model(input_ids=tokens()).logits
    dims = dict(tree.leaves_with_paths(decls))

    def back(x, path=""):
        if isinstance(x, dict):
            return {k: back(v, f"{path}.{k}".lstrip(".")) for k, v in x.items()}
        if isinstance(x, list):
            return [back(v, f"{path}.{i}") for i, v in enumerate(x)]
        if not isinstance(x, QuantizedWeight):
            return x
        d = dims[path].dims
        return dequantize(x, block_dim=d.index(block_dim(path.split(".")[-1], d))).reshape(dims[path].shape)
    deq = back(qp)
    hf.save_hf_llama(deq, cfg, out_dir / "deq")
    theirs = transformers.KimiLinearForCausalLM.from_pretrained(out_dir / "deq", dtype=torch.float32, **EAGER)
    with torch.no_grad():
        want = theirs(input_ids=tokens()).logits
    assert (want - full).abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    return qp


def test_context_parallel_equals_one_device(saved):
    """CP 2: the delta attention's state (a decay per key channel) handed from block to block along the
    sequence (ops/sequence_chain.py) = one device in the loss and every gradient."""
    assert_hf_layout_equals_one_device(saved[1], "cp")


def test_refusals_name_the_option(saved, tmp_path):
    """Sampling with a k/v cache (the delta attention's state is not cached) and config.json values
    the decoder cannot reproduce are refused by name before any work."""
    cfg, params = hf.load_hf_llama(saved[1])
    from functional_pp.models import families_table, sampling  # noqa: F401
    from functional_pp.parallel import sharding
    named = sharding.named_tree(params, llama.init(cfg))
    with pytest.raises(ValueError, match=r"key / value cache does not support kimi_delta_attention"):
        sampling.generate(lambda p, t: llama.forward(p, t, cfg), named, tokens(batch=1, seq=4), max_new_tokens=2)
    assert "layers [0, 2] are kimi_delta_attention (Kimi Delta Attention)" in llama.uncached_layers(cfg)
    assert "layers [0, 2] are kimi_delta_attention" in llama.serial_under_cp(cfg)
    conf = json.loads((saved[1] / "config.json").read_text())
    for key, value, what in (("attention_bias", True, "has no biases"), ("attention_dropout", 0.1, "set it to 0.0"),
                             ("hidden_act", "gelu", "only 'silu'"),
                             ("layer_types", ["linear_attention"] * 2, "must be 3 entries"),
                             ("num_key_value_heads", 2, "num_key_value_heads=2 != num_attention_heads=4")):
        with pytest.raises(ck.CheckpointMismatchError, match=rf"HF kimi_linear config: .*{what}"):
            hf.config_from_hf(dict(conf, **{key: value}))
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'kimi_linear': nope_layers=None has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, nope_layers=None), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"export as 'deepseek_v3': .*Kimi Delta Attention layers.*choose model_type kimi_linear"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="deepseek_v3"), tmp_path / "no")
