"""DeepSeek-V3, DeepSeek-V2 (a latent attention without a q latent; softmax routing limited to the
best groups), GLM-4.5 (``glm4_moe``: partial rotary, q/k/v biases, q/k norms) and GLM-4.7-Flash
(``glm4_moe_lite``) as configurations of the one decoder (models/llama.py, models/mla.py,
models/moe.py): tiny random models built by ``transformers`` load through the HF import; logits,
the loss and every gradient equal transformers'; export writes the same class, which loads with
equal logits; FSDP x TP and EP x TP on simulated devices, and TP on real gloo processes, equal
one device; what the classes cannot hold is refused by name."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from harness import (assert_1f1b_equals_one_device, assert_export_round_trip, make_batch, our_logits, parallel,
                     single_device, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            rms_norm_eps=1e-5, max_position_embeddings=128, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
# the latent attention: q and k heads of 12 + 8 entries (8 rotated), v heads of 16
MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16)
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        BASE, **MLA, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        BASE, **dict(MLA, q_lora_rank=None), n_group=4, topk_group=1, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        BASE, num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True, n_group=2, topk_group=1,
        routed_scaling_factor=1.5)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(BASE, **MLA, routed_scaling_factor=1.8)),
}
EAGER = dict(attn_implementation="eager", experts_implementation="eager")
# per family, switches whose absence changes the logits
SWITCHED_OFF = {"deepseek_v3": [dict(router_groups=1, router_topk_groups=1), dict(rotary_interleaved=False),
                                dict(routed_scaling_factor=1.0)],
                "deepseek_v2": [dict(router_groups=1, router_topk_groups=1), dict(rotary_interleaved=False)],
                "glm4_moe": [dict(partial_rotary_factor=1.0), dict(router_groups=1, router_topk_groups=1)],
                "glm4_moe_lite": [dict(routed_scaling_factor=1.0)]}


def _build(family: str, tmp, **more):
    conf, cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, conf)(**{**kw, **more})).float().eval()
    with torch.no_grad():              # O(1) logits, routers far from uniform, a score correction that matters
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(tmp, safe_serialization=True)
    model.config._attn_implementation = model.config._experts_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family)
        out[family] = (_build(family, d), d)
    return out


def test_configs_read_each_family(saved):
    cfg = hf.config_from_hf(saved["deepseek_v3"][1])
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        16, 24, 12, 8, 16)
    assert (cfg.experts, cfg.moe_mlp, cfg.shared_expert_mlp, cfg.shared_expert_gate, cfg.moe_layers) == (
        8, 32, 32, False, (1, 2))
    assert (cfg.router_score, cfg.router_bias, cfg.router_groups, cfg.router_topk_groups, cfg.router_group_score,
            cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.rotary_interleaved) == (
        "sigmoid", True, 4, 2, "top2_sum", True, 2.5, True)
    assert "router" not in llama.init(cfg)["layers"][0]["mlp"] and "router_bias" in llama.init(cfg)["layers"][1]["mlp"]
    cfg = hf.config_from_hf(saved["deepseek_v2"][1])
    assert (cfg.q_lora_rank, cfg.router_score, cfg.router_bias, cfg.router_group_score, cfg.norm_topk_prob) == (
        None, "softmax", False, "max", False)
    assert "q_proj" in llama.init(cfg)["layers"][0]["self_attn"]
    cfg = hf.config_from_hf(saved["glm4_moe"][1])
    assert (cfg.kv_lora_rank, cfg.partial_rotary_factor, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.dim_head) == (
        0, 0.5, True, False, True, 32)
    cfg = hf.config_from_hf(saved["glm4_moe_lite"][1])
    assert (cfg.kv_lora_rank, cfg.moe_layers, cfg.routed_scaling_factor) == (16, (1, 2), 1.8)
    assert llama.Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_logits_equal_transformers(saved, family):
    model, d = saved[family]
    cfg, params = hf.load_hf_llama(d)
    assert cfg.model_type == family
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    assert want.abs().max() > 0.5
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
    for change in SWITCHED_OFF[family]:
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change


def _hf_grad(ours: dict, name: str, cfg) -> torch.Tensor:
    """Our gradient of the in-memory transformers parameter ``name`` (its experts fused:
    ``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F])."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("experts.gate_up_proj"):
        g, u = ours[f"layers.{layer}.mlp.gate"], ours[f"layers.{layer}.mlp.up"]
        return torch.cat([g.transpose(1, 2), u.transpose(1, 2)], dim=1)
    if name.endswith("experts.down_proj"):
        return ours[f"layers.{layer}.mlp.down"].transpose(1, 2)
    files = dict(hf._file_tensors(llama.init(cfg), cfg))
    return torch.cat([kind.to_hf(ours[p]) for p, kind, _ in files[name]])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_gradients_equal_transformers(saved, family):
    _, d = saved[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, **EAGER)
    cfg, params = hf.load_hf_llama(d, dtype=torch.float64)
    batch = make_batch(cfg, batch=3, seq=12, seed=2)
    loss, grads = single_device(cfg, params, batch)
    logits = model(input_ids=batch["tokens"]).logits
    want = F.cross_entropy(logits.reshape(-1, cfg.vocab), batch["labels"].reshape(-1))
    want.backward()
    # (transformers' router is float32 even in a float64 model; ours is float64)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    for name, p in model.named_parameters():        # (transformers keeps the router's weight in float32)
        torch.testing.assert_close(_hf_grad(ours, name, cfg), p.grad.double(), rtol=1e-4,
                                   atol=1e-5 * p.grad.abs().max().item(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_round_trip_in_transformers(saved, tmp_path, family):
    assert_export_round_trip(saved[family][1], tmp_path / "out", family, FAMILIES[family][1], **EAGER)


def test_yarn_softmax_scale_equals_transformers(tmp_path):
    """DeepSeek-V3's YaRN: the rotary's attention factor from mscale / mscale_all_dim, and the
    softmax scale times mscale_all_dim's mscale squared; the export writes what gives them back."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    model = _build("deepseek_v3", tmp_path / "in", rope_parameters=rope)
    cfg, params = hf.load_hf_llama(tmp_path / "in")
    assert cfg.query_pre_attn_scalar is not None and abs(cfg.query_pre_attn_scalar - 20) > 1
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, query_pre_attn_scalar=None), toks), want,
                              atol=1e-3)
    out = hf.save_hf_llama(params, cfg, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **EAGER)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=toks).logits, want, atol=1e-5, rtol=1e-5)


MESH = fpp.Mesh(dp_shard=2, tp=2)


@pytest.mark.parametrize("family,mesh,rules", [
    ("deepseek_v3", MESH, llama.default_rules()),                                 # FSDP x TP
    ("glm4_moe_lite", MESH, llama.default_rules()),
    ("deepseek_v3", MESH, fpp.Rules(batch="dp_shard", experts="dp_shard", heads="tp", kv_heads="tp", vocab="tp",
                                    mlp="tp")),                                   # EP x TP
    ("deepseek_v2", fpp.Mesh(cp=2, tp=2), llama.default_rules(fsdp=False, sequence_parallel=True))])   # CP x TP + SP
def test_layouts_equal_one_device(saved, family, mesh, rules):
    _, d = saved[family]
    cfg, full64 = hf.load_hf_llama(d, dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss0, grads0 = single_device(cfg, full64, batch)
    for rank, (loss, grads, _) in enumerate(parallel(cfg, full64, batch, mesh, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            if g0 is None:                 # (the router's score correction: no gradient)
                continue
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


@pytest.mark.parametrize("mesh,rules", [
    (fpp.Mesh(tp=2), llama.default_rules(fsdp=False)),
    (fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", experts="dp_shard", hidden="dp_shard"))],   # EP x FSDP
    ids=["tp", "ep_fsdp"])
def test_latent_attention_and_grouped_routing_train_alike_on_real_processes(mesh, rules):
    """A latent attention (q latent, v heads wider than q/k) with DeepSeek-V3's router (sigmoid,
    score correction, groups, scaled weights) and a shared expert after a dense layer: two AdamW
    steps with TP 2, and with the experts (and their score corrections) split over the batch's
    axis with FSDP, on two gloo processes equal one device."""
    from harness import launch_steps
    cfg = llama.Config.tiny(kv_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                            v_head_dim=16, rotary_interleaved=True, experts=4, experts_top_k=2, moe_mlp=16,
                            shared_expert_mlp=16, shared_expert_gate=False, router_score="sigmoid", router_bias=True,
                            router_groups=2, router_topk_groups=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                            moe_layers=(1,), model_type="deepseek_v3")
    one = launch_steps(cfg, dtype=torch.float64)[0]
    real = launch_steps(cfg, mesh=mesh, rules=rules, dtype=torch.float64, processes=True)
    for losses, params, _ in real:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=1e-10, atol=0)
        for p, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one[1][p]), rtol=1e-8, atol=1e-12,
                                       msg=lambda m: f"{p}: {m}")


def test_refusals_name_the_setting(saved, tmp_path):
    conf = json.loads((saved["deepseek_v2"][1] / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF deepseek_v2 config: topk_method='noaux_tc' is not "
                                                         r"supported \(only greedy, group_limited_greedy"):
        hf.config_from_hf(dict(conf, topk_method="noaux_tc"))
    conf = json.loads((saved["deepseek_v3"][1] / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF deepseek_v3 config: attention_bias=True is not "
                                                         r"supported with latent attention"):
        hf.config_from_hf(dict(conf, attention_bias=True))
    with pytest.raises(ck.CheckpointMismatchError, match=r"moe_layer_freq=2 is not supported"):
        hf.config_from_hf(dict(conf, moe_layer_freq=2))
    with pytest.raises(ck.CheckpointMismatchError, match=r"rope type 'dynamic' is not supported"):
        hf.config_from_hf(dict(conf, rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ck.CheckpointMismatchError, match=r"router_groups=3 must divide experts=8"):
        hf.config_from_hf(dict(conf, n_group=3))
    cfg = hf.config_from_hf(saved["deepseek_v3"][1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'deepseek_v3': router_score='softmax' has no "
                                                         r"DeepseekV3ForCausalLM equivalent"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, router_score="softmax"), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'qwen3_moe': kv_lora_rank=16 \(latent "
                                                         r"attention\) has no Qwen3MoeForCausalLM equivalent"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="qwen3_moe"), tmp_path / "no")
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match=r"kv_heads=2 must equal heads=4 with multi-head latent attention"):
        dataclasses.replace(cfg, kv_heads=2)


def test_lora_on_the_latent_attention_equals_peft(tmp_path):
    """LoRA on every projection of DeepSeek-V3's latent attention (B nonzero): the loss and every
    adapter gradient equal peft's on transformers' model."""
    pytest.importorskip("peft")
    from harness import assert_lora_step_equals_peft
    model = _build("deepseek_v3", tmp_path)
    assert_lora_step_equals_peft(model, tmp_path, ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))


def test_greedy_generation_with_the_cache_equals_transformers(saved):
    """Sampling with the key / value cache (models/sampling.py) through the latent attention: the
    greedy tokens equal transformers' ``generate``."""
    import functools

    from functional_pp.models.sampling import generate
    from functional_pp.parallel import sharding
    model, d = saved["deepseek_v3"]
    cfg, params = hf.load_hf_llama(d)
    prompts = torch.randint(1, 256, (3, 6), generator=torch.Generator().manual_seed(1))
    want = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    got = generate(functools.partial(llama.forward, cfg=cfg), sharding.named_tree(params, llama.init(cfg)), prompts,
                   max_new_tokens=10)
    assert torch.equal(got, want)
    assert len(set(got[:, 6:].flatten().tolist())) > 3
    from functional_pp.models.sampling import left_padded       # prompts of different lengths, left-padded
    tokens, mask = left_padded([prompts[0].tolist(), prompts[1, :2].tolist(), prompts[2, :4].tolist()])
    want = model.generate(tokens, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    got = generate(functools.partial(llama.forward, cfg=cfg), sharding.named_tree(params, llama.init(cfg)), tokens,
                   attention_mask=mask, max_new_tokens=10)
    assert torch.equal(got, want)


def test_pipeline_of_dense_and_expert_layers_equals_one_device():
    """PP 2 (1F1B, 4 micro-batches) of latent-attention layers, a dense one first and experts with
    DeepSeek-V3's router after it: the losses of two AdamW steps (the second after the update)
    equal one device's."""
    cfg = llama.Config.tiny(layers=4, kv_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=16, rotary_interleaved=True, experts=4, experts_top_k=2,
                            moe_mlp=16, shared_expert_mlp=16, shared_expert_gate=False, router_score="sigmoid",
                            router_bias=True, router_groups=2, router_topk_groups=1, routed_scaling_factor=2.5,
                            moe_layers=(1, 2, 3), model_type="deepseek_v3")
    one = assert_1f1b_equals_one_device(cfg)
    assert one[0] != one[1]


def test_nf4_latent_attention_equals_transformers_with_bitsandbytes(tmp_path):
    """QLoRA's base (``load_in_4bit``, NF4): DeepSeek-V3 quantized by transformers + bitsandbytes
    and by us (every linear of the latent attention, the dense and shared MLPs; the experts' 3-D
    weights and the router stay, as there) gives the same logits. Sizes hold whole blocks of 64."""
    pytest.importorskip("bitsandbytes")
    from functional_pp.models.quantize import quantize_linear_weights
    from functional_pp.parallel import sharding
    model = _build("deepseek_v3", tmp_path, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                   kv_lora_rank=64, q_lora_rank=64, v_head_dim=64, qk_nope_head_dim=56, qk_rope_head_dim=8)
    with torch.no_grad():
        full = model(input_ids=tokens()).logits
    bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                                          bnb_4bit_compute_dtype=torch.float32)
    q = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb, dtype=torch.float32,
                                                          device_map="cpu", **EAGER).eval()
    for module in q.modules():           # (bitsandbytes' bf16 CPU path off: the fp32 compute asked for)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        want = q(input_ids=tokens()).logits
    cfg, params = hf.load_hf_llama(tmp_path)
    qp, qd = quantize_linear_weights(params, llama.init(cfg), "nf4", double_quant=False)
    with torch.no_grad():
        got = llama.forward(sharding.named_tree(qp, qd), fpp.wrap(tokens(), "batch seq"), cfg).value()
    assert (want - full).abs().max() > 0.02
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
