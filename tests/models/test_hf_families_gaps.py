"""The gaps the families table named, each closed as an option of the one decoder
(models/llama.py, models/hf_switches.py): Ministral 3 (Mistral with the queries scaled by
position in every layer: the attention temperature tuning Llama 4 has in its NoPE layers, offset
0); Command R+ (Cohere with ``use_qk_norm``: a LayerNorm of q and k with a weight per head,
``qk_norm_per_head``); OLMoE's ``clip_qkv`` (DBRX's clamp, after the q/k norms); Nemotron's
``mlp_bias``. Tiny random models built by ``transformers`` from a config (no download) load through the HF
import; logits equal transformers' (fp32), the loss and every gradient too (fp64); FSDP 2 x TP 2
on a simulated mesh equals one device; export writes the same class, which loads with equal
logits; LoRA's loss and adapter gradients equal peft's; what the classes cannot hold is refused
by name; the new options train alike on real gloo processes."""
import dataclasses
import json
import math
import re

import pytest
import torch
from harness import (assert_export_round_trip, fp64_beside_hf, import_logits_beside_hf, make_batch, our_logits, parallel,
                     single_device, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=128, pad_token_id=None, bos_token_id=None,
            eos_token_id=None)
# YaRN over 4 positions with Llama 4's scaling: the queries of positions 4.. scaled (the 12-token batches)
MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=4,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.3)
# name -> (model_type, config class, model class, config)
FAMILIES = {
    "ministral3": ("ministral3", "Ministral3Config", "Ministral3ForCausalLM", dict(
        BASE, head_dim=16, rope_parameters=MINISTRAL3_ROPE)),
    # a plain rope with the scaling (no YaRN), and a window in every layer
    "ministral3_plain": ("ministral3", "Ministral3Config", "Ministral3ForCausalLM", dict(
        BASE, head_dim=16, sliding_window=6, rope_parameters=dict(rope_type="default", rope_theta=1000.0,
                                                                  original_max_position_embeddings=3,
                                                                  llama_4_scaling_beta=0.5))),
    # Command R+: q/k LayerNorms of a weight per head (heads x head_dim), each head over head_dim
    "cohere_qk": ("cohere", "CohereConfig", "CohereForCausalLM", dict(BASE, use_qk_norm=True, logit_scale=0.5)),
    # OLMoE: q, k and v clamped after the q/k norms (a bound the normed q/k entries pass)
    "olmoe_clip": ("olmoe", "OlmoeConfig", "OlmoeForCausalLM", dict(
        BASE, intermediate_size=32, num_experts=4, num_experts_per_tok=2, clip_qkv=0.8)),
    # StableLM 2 (12B / Zephyr): a bias-free LayerNorm of q and k per head (qk_layernorm), a quarter of head_dim rotating
    "stablelm_qk": ("stablelm", "StableLmConfig", "StableLmForCausalLM", dict(
        BASE, qk_layernorm=True, use_qkv_bias=True, partial_rotary_factor=0.25)),
    # Mistral Small 4: DeepSeek-V3's latent attention (a q latent, interleaved rotary, YaRN's softmax scale) with
    # Ministral 3's queries scaled by position (from position 4 on), a dense layer then routed + shared experts
    # under a softmax router limited to the best 2 of 4 groups
    "mistral4": ("mistral4", "Mistral4Config", "Mistral4ForCausalLM", dict(
        BASE, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_parameters=dict(MINISTRAL3_ROPE, factor=2.0))),
    # Nemotron with the biases of its MLP's projections
    "nemotron_bias": ("nemotron", "NemotronConfig", "NemotronForCausalLM", dict(BASE, norm_eps=1e-5, mlp_bias=True)),
}
# the switches whose removal must change the logits (they are not no-ops)
SWITCHED_OFF = {"ministral3": [dict(attn_temperature_floor=None), dict(attn_temperature_offset=1.0)],
                "ministral3_plain": [dict(attn_temperature_floor=None), dict(sliding_window=None)],
                "cohere_qk": [], "stablelm_qk": [], "olmoe_clip": [dict(clip_qkv=None)],
                "mistral4": [dict(attn_temperature_floor=None), dict(router_groups=1, router_topk_groups=1),
                             dict(rotary_interleaved=False)], "nemotron_bias": []}
LORA = {"ministral3": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "cohere_qk": ("q_proj", "k_proj", "v_proj", "o_proj"), "stablelm_qk": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "mistral4": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")}
EAGER = dict(attn_implementation="eager", experts_implementation="eager")
MESH = fpp.Mesh(dp_shard=2, tp=2)


def _build(name: str):
    _, conf, cls, kw = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, conf)(**kw)).float().eval()
    with torch.no_grad():               # O(1) logits, non-trivial norms and biases
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
    model.config._attn_implementation = model.config._experts_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name in FAMILIES:
        model = _build(name)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, safe_serialization=True)
        out[name] = (model, d)
    return out


def test_configs_read_each_family(saved):
    cfg = hf.config_from_hf(saved["ministral3"][1])
    assert (cfg.attn_temperature_floor, cfg.attn_temperature_scale, cfg.attn_temperature_offset,
            cfg.attn_temperature_all_layers, cfg.rope_scaling.original_max_position) == (4.0, 0.3, 0.0, True, 4)
    cfg = hf.config_from_hf(saved["ministral3_plain"][1])
    assert (cfg.attn_temperature_floor, cfg.attn_temperature_scale, cfg.rope_scaling, cfg.sliding_window) == (
        3.0, 0.5, None, 6)
    # Ministral3Config's rope where config.json has none: YaRN 16 over 16384, base 1e6, beta 0.1
    cfg = hf.config_from_hf(dict(BASE, model_type="ministral3"))
    assert (cfg.rope_theta, cfg.rope_scaling.factor, cfg.attn_temperature_floor, cfg.attn_temperature_scale,
            cfg.dim_head) == (1e6, 16.0, 16384.0, 0.1, 128)
    assert llama.Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    cfg = hf.config_from_hf(saved["olmoe_clip"][1])
    assert (cfg.clip_qkv, cfg.experts, cfg.qk_norm_heads) == (0.8, 4, True)
    cfg = hf.config_from_hf(saved["nemotron_bias"][1])
    assert cfg.mlp_bias and "up_bias" in llama.init(cfg)["layers"][0]["mlp"]
    cfg = hf.config_from_hf(saved["cohere_qk"][1])
    assert (cfg.qk_norm, cfg.qk_norm_per_head, cfg.norm_kind) == (True, True, "layer")
    assert llama.init(cfg)["layers"][0]["self_attn"]["k_norm"].dims == ("kv_heads", "head_dim")
    cfg = hf.config_from_hf(saved["mistral4"][1])
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.rotary_interleaved, cfg.partial_rotary_factor,
            cfg.router_score, cfg.router_bias, cfg.router_groups, cfg.router_topk_groups, cfg.router_group_score,
            cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.moe_layers, cfg.shared_expert_mlp) == (
        16, 24, 8, True, 1.0, "softmax", False, 4, 2, "top2_sum", True, 1.5, (1,), 32)
    assert (cfg.attn_temperature_floor, cfg.attn_temperature_scale, cfg.attn_temperature_offset,
            cfg.attn_temperature_all_layers, cfg.rope_scaling.original_max_position) == (4.0, 0.3, 0.0, True, 4)
    # Mistral4Config's rope where config.json has none: YaRN 128 over 8192, beta 0.1, its softmax scale
    cfg = hf.config_from_hf(dict(FAMILIES["mistral4"][3], model_type="mistral4", rope_parameters=None))
    assert (cfg.rope_theta, cfg.rope_scaling.factor, cfg.attn_temperature_floor, cfg.attn_temperature_scale) == (
        1e4, 128.0, 8192.0, 0.1)
    assert cfg.query_pre_attn_scalar == pytest.approx(20 / (0.1 * math.log(128.0) + 1) ** 4)
    assert llama.Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    cfg = hf.config_from_hf(saved["stablelm_qk"][1])
    assert (cfg.qk_norm, cfg.qk_norm_per_head, cfg.norm_kind, cfg.partial_rotary_factor) == (True, True, "layer", 0.25)
    # the files hold one LayerNorm per head: q_layernorm.norms.{h}.weight, stacked into q_norm [heads, head_dim]
    files = {n for n, _ in hf._file_tensors(llama.init(cfg), cfg)}
    assert "model.layers.0.self_attn.q_layernorm.norms.weight" in files


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_logits_equal_transformers(saved, name):
    cfg, params, toks, want = import_logits_beside_hf(*saved[name])
    assert cfg.model_type == FAMILIES[name][0]
    for change in SWITCHED_OFF[name]:
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change


def _hf_grads(model, cfg, grads) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, ours, transformers') of every gradient of the in-memory transformers model."""
    ours = dict(tree.leaves_with_paths(grads))
    files = {n: parts for n, parts in hf._file_tensors(llama.init(cfg), cfg)}
    out = []
    for name, p in model.named_parameters():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):         # (transformers fuses them in memory: [E, 2F, H])
            out.append((name, torch.cat([ours[f"layers.{layer}.mlp.{x}"].transpose(1, 2) for x in ("gate", "up")],
                                        dim=1), p.grad))
            continue
        if name.endswith("experts.down_proj"):
            out.append((name, ours[f"layers.{layer}.mlp.down"].transpose(1, 2), p.grad))
            continue
        head = re.search(r"\.norms\.(\d+)\.", name)       # (StableLM: one LayerNorm per head, row h of ours)
        if head:
            (q, _, _), = files[name.replace(head.group(0), ".norms.")]
            out.append((name, ours[q][int(head.group(1))], p.grad))
            continue
        parts = files[name]
        g = hf.fuse_rows([kind.to_hf(ours[q]) for q, kind, _ in parts], cfg, getattr(parts[0][1], "row_axis", 0))
        out.append((name, g, p.grad))
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_loss_and_gradients_equal_transformers(saved, name):
    _, d = saved[name]        # (by its class: transformers 5.25's AutoModelForCausalLM does not map Mistral4Config)
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, FAMILIES[name][2], **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6 if cfg.experts else 1e-7, atol=0)
    got = _hf_grads(model, cfg, grads)
    assert len(got) == len(list(model.parameters()))
    for n, g, g0 in got:
        torch.testing.assert_close(g, g0, rtol=1e-5, atol=max(1e-6 * g0.abs().max().item(), 1e-8),
                                   msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fsdp_tp_equals_one_device(saved, name):
    """FSDP 2 x TP 2 on a simulated mesh: the loss and every gradient equal one device's (fp64)."""
    cfg, full64 = hf.load_hf_llama(saved[name][1], dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss0, grads0 = single_device(cfg, full64, batch)
    rules = llama.default_rules().replace(experts="dp_shard") if cfg.experts else llama.default_rules()   # (EP)
    for rank, (loss, grads, _) in enumerate(parallel(cfg, full64, batch, MESH, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_round_trip_in_transformers(saved, tmp_path, name):
    mt, _, cls, _ = FAMILIES[name]
    assert_export_round_trip(saved[name][1], tmp_path / "out", mt, cls, **EAGER)


@pytest.mark.parametrize("name", list(LORA))
def test_lora_equals_peft(saved, name):
    """LoRA (B nonzero) on the family's projections: the loss and every adapter gradient equal
    peft's on transformers' model."""
    pytest.importorskip("peft")
    from harness import assert_lora_step_equals_peft
    targets, d = LORA[name], saved[name][1]
    assert_lora_step_equals_peft(getattr(transformers, FAMILIES[name][2]).from_pretrained(d, dtype=torch.float32,
                                                                                          **EAGER), d, targets)


def test_refused_by_name(saved, tmp_path):
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF ministral3 config: rope_parameters needs "
                                                         r"llama_4_scaling_beta and original_max_position_embeddings"):
        hf.config_from_hf(dict(BASE, model_type="ministral3", rope_parameters=dict(rope_type="default",
                                                                                   rope_theta=1e4)))
    # export refuses what the class cannot hold, before writing anything
    cfg = hf.config_from_hf(saved["ministral3"][1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    for change, msg in ((dict(attn_temperature_floor=8.0), r"attn_temperature_floor=8.0 has no Ministral3ForCausalLM "
                                                           r"equivalent \(it needs 4.0\)"),
                        (dict(attn_temperature_offset=1.0), r"attn_temperature_offset=1.0 has no"),
                        (dict(qk_norm=True), r"qk_norm=True has no"), (dict(qk_norm=True, qk_norm_per_head=True),
                                                                          r"qk_norm_per_head=True has no")):
        with pytest.raises(ck.CheckpointMismatchError, match=rf"export as 'ministral3': {msg}"):
            hf.save_hf_llama(params, dataclasses.replace(cfg, **change), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'mistral': attn_temperature_floor=4.0 has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="mistral"), tmp_path / "no")
    cfg = hf.config_from_hf(saved["cohere_qk"][1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'cohere': qk_norm_per_head=False has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, qk_norm_per_head=False), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'cohere2': qk_norm=True has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="cohere2", nope_layers=(0, 1)), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF cohere2 config: use_qk_norm=True is not supported"):
        hf.config_from_hf(dict(BASE, model_type="cohere2", use_qk_norm=True))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF phi config: qk_layernorm=True \(Phi's LayerNorm of q and "
                                                         r"k, with a bias, shared by the heads\) is not supported yet"):
        hf.config_from_hf(dict(BASE, model_type="phi", qk_layernorm=True))
    cfg = hf.config_from_hf(saved["stablelm_qk"][1])
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'stablelm': qk_norm_per_head=False has no"):
        hf.save_hf_llama(fpp.init_params(llama.init(dataclasses.replace(cfg, qk_norm_per_head=False)), seed=0),
                         dataclasses.replace(cfg, qk_norm_per_head=False), tmp_path / "no")
    m4 = FAMILIES["mistral4"][3]
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF mistral4 config: rope type 'default' is not supported "
                                                         r"\(transformers' Mistral4 sizes only YaRN's rotary"):
        hf.config_from_hf(dict(m4, model_type="mistral4", rope_parameters=dict(rope_type="default", rope_theta=1e4)))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF mistral4 config: rope_parameters needs "
                                                         r"llama_4_scaling_beta and original_max_position_embeddings"):
        rope = {k: v for k, v in m4["rope_parameters"].items() if k != "llama_4_scaling_beta"}
        hf.config_from_hf(dict(m4, model_type="mistral4", rope_parameters=rope))
    cfg = hf.config_from_hf(saved["mistral4"][1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    for change, msg in ((dict(attn_temperature_floor=8.0), r"attn_temperature_floor=8.0 has no Mistral4ForCausalLM "
                                                           r"equivalent \(it needs 4.0\)"),
                        (dict(router_score="sigmoid"), r"router_score='sigmoid' has no"),
                        (dict(rope_scaling=None), r"rope_scaling NoneType is not exported for mistral4")):
        with pytest.raises(ck.CheckpointMismatchError, match=rf"export as 'mistral4': {msg}"):
            hf.save_hf_llama(params, dataclasses.replace(cfg, **change), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'deepseek_v3': attn_temperature_floor=4.0 has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="deepseek_v3", router_score="sigmoid",
                                                     router_bias=True), tmp_path / "no")
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("name", ["cohere_qk", "stablelm_qk"])
def test_qk_norm_per_head_is_each_heads_own(saved, name):
    """Each head's q/k norm weight acts on that head only: a per-head weight that differs per head
    (as the files', StableLM's one LayerNorm per head) is needed for transformers' logits."""
    model, d = saved[name]
    cfg, params = hf.load_hf_llama(d)
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    shared = tree.tree_map(lambda x: x, params)
    for layer in shared["layers"]:
        for n in ("q_norm", "k_norm"):
            w = layer["self_attn"][n]
            layer["self_attn"][n] = w.mean(0, keepdim=True).expand_as(w).clone()
    assert not torch.allclose(our_logits(shared, cfg, toks), want, atol=1e-3)
    with pytest.raises(ValueError, match=r"qk_norm_per_head=True needs qk_norm=True and qk_norm_heads=False"):
        llama.Config.tiny(qk_norm_per_head=True)


def test_new_options_train_alike_on_real_processes():
    """Two float64 AdamW steps with FSDP 2 x TP 2 on four real gloo processes of a tiny model with
    every option of this file on equal one device: Ministral 3's scaled queries (each rank's own
    positions), q/k LayerNorms of a weight per head (split with the heads over tp), the q/k/v clamp after
    them and the MLP's biases (the down projection's added after the TP partial sums)."""
    from harness import assert_processes_equal_one_device
    cfg = llama.Config.tiny(attn_temperature_floor=4.0, attn_temperature_scale=0.5, attn_temperature_offset=0.0,
                            attn_temperature_all_layers=True, norm_kind="layer", qk_norm=True, qk_norm_per_head=True,
                            clip_qkv=1.5, mlp_bias=True)
    assert_processes_equal_one_device(cfg)


def test_mistral4_trains_alike_on_real_processes():
    """Two float64 AdamW steps with FSDP 2 x EP 2 x TP 2 (experts over dp_shard) on four real gloo
    processes of a tiny Mistral Small 4 (latent attention with its queries scaled by position, a
    dense layer, then a softmax router over groups with a shared expert) equal one device."""
    from harness import assert_processes_equal_one_device
    cfg = llama.Config.tiny(kv_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                            v_head_dim=16, rotary_interleaved=True, attn_temperature_floor=4.0,
                            attn_temperature_scale=0.5, attn_temperature_offset=0.0, attn_temperature_all_layers=True,
                            experts=4, experts_top_k=2, moe_mlp=32, moe_layers=(1,), router_groups=2,
                            router_topk_groups=1, norm_topk_prob=True, routed_scaling_factor=1.5,
                            shared_expert_mlp=32, shared_expert_gate=False, model_type="mistral4")
    assert_processes_equal_one_device(cfg, rules=llama.default_rules().replace(experts="dp_shard"))


def test_greedy_generation_with_the_cache_equals_transformers(saved):
    """Sampling with the key / value cache (models/sampling.py): Ministral 3's scaled queries use each
    new token's own position (past the cached ones), so the greedy tokens equal transformers'."""
    import functools

    from functional_pp.models.sampling import generate
    from functional_pp.parallel import sharding
    model, d = saved["ministral3"]
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
