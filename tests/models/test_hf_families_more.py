"""Seed-OSS, Apertus (xIELU, per-head q/k norms), Hunyuan dense (q/k norms after the rotary,
NTK-alpha rope), Falcon (multi-query, the new decoder architecture with grouped k/v and two
norms, the old sequential layer) and Granite MoE with a shared expert as configurations of the
one decoder (models/llama.py, models/hf_switches.py): tiny random models built by
``transformers`` from a config (no download) load through the HF import; logits equal
transformers' (fp32), the loss and every gradient too (fp64); FSDP 2 x TP 2 on a simulated mesh
equals one device (each device reading its own shards of the files, Falcon's fused q/k/v
included), the MoE under EP x TP too; export writes the same class, which loads with equal
logits; what the classes cannot hold is refused by name; the new options train alike on real
gloo processes."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from harness import (assert_1f1b_equals_one_device, assert_export_round_trip, fp64_beside_hf,
                     import_logits_beside_hf, make_batch, our_logits, parallel, single_device, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.core.layout import block_slices
from functional_pp.models import llama
from functional_pp.parallel import sharding
from functional_pp.parallel.named import settle

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=128)
FALCON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
              bos_token_id=None, eos_token_id=None)
# name -> (model_type, config class, model class, config)
FAMILIES = {
    # q/k/v biases and an output bias of their own (attention_out_bias), head_dim != hidden / heads
    "seed_oss": ("seed_oss", "SeedOssConfig", "SeedOssForCausalLM", dict(
        BASE, head_dim=32, attention_bias=True, attention_out_bias=True, attention_dropout=0.0, residual_dropout=0.0,
        pad_token_id=None)),
    # xIELU MLP (not gated) with its two scalars per layer, per-head q/k RMSNorms, renamed norms
    "apertus": ("apertus", "ApertusConfig", "ApertusForCausalLM", dict(
        BASE, pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # q/k RMSNorms after the rotary; the NTK-alpha rope (a larger fixed base)
    "hunyuan_v1_dense": ("hunyuan_v1_dense", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(
        BASE, head_dim=16, pad_token_id=None,
        rope_parameters={"rope_type": "dynamic", "alpha": 10.0, "factor": 1.0, "rope_theta": 1000.0})),
    # Falcon-7B: multi-query (one k/v head), attention and MLP in parallel from one LayerNorm, no biases
    "falcon_7b": ("falcon", "FalconConfig", "FalconForCausalLM", FALCON),
    # Falcon-40B / 180B: the new decoder architecture (k/v heads, q/k/v fused k/v head by k/v head,
    # ln_attn and ln_mlp), with biases
    "falcon_40b": ("falcon", "FalconConfig", "FalconForCausalLM", dict(
        FALCON, num_kv_heads=2, new_decoder_architecture=True, bias=True)),
    # the old layer without multi-query, sequential (input and post-attention LayerNorms)
    "falcon_seq": ("falcon", "FalconConfig", "FalconForCausalLM", dict(
        FALCON, multi_query=False, parallel_attn=False, bias=True, tie_word_embeddings=False)),
    # Granite MoE with a shared expert (its gate and up fused, added without a gate)
    "granitemoeshared": ("granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        BASE, intermediate_size=32, shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=4.0,
        output_router_logits=True, router_aux_loss_coef=0.1)),
    # OLMoE: Llama's layers with q/k RMSNorms over every head, a mixture of experts of
    # intermediate_size (softmax router, top-k weights not renormalised)
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeForCausalLM", dict(
        BASE, intermediate_size=32, num_experts=4, num_experts_per_tok=2, pad_token_id=None, eos_token_id=None,
        output_router_logits=True, router_aux_loss_coef=0.1)),
    # Gemma (1): tanh-GELU GLU, RMSNorms scaled by 1 + w, the embedding times sqrt(hidden), tied
    "gemma": ("gemma", "GemmaConfig", "GemmaForCausalLM", dict(BASE, head_dim=16, pad_token_id=None)),
    # GLM-4-9B: q/k/v biases (no output bias), half of each head rotating pairs (2i, 2i+1), gate / up fused
    "glm": ("glm", "GlmConfig", "GlmForCausalLM", dict(BASE, head_dim=16, pad_token_id=None)),
    # GLM-4-0414: GLM's layer with norms after attention and after the MLP too
    "glm4": ("glm4", "Glm4Config", "Glm4ForCausalLM", dict(BASE, head_dim=16, pad_token_id=None)),
    # ERNIE 4.5: pairs (2i, 2i+1) rotating over the whole head, biases on every linear (use_bias)
    "ernie4_5": ("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", dict(BASE, head_dim=16, use_bias=True,
                                                                          pad_token_id=None)),
    # StarCoder 2: LayerNorms, a tanh-GELU MLP not gated, biases everywhere, a window in every layer
    "starcoder2": ("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", dict(
        BASE, sliding_window=5, bos_token_id=None, eos_token_id=None)),
    # Nemotron (Minitron): LayerNorm1P (1 + w, a bias), squared ReLU not gated, half of each head rotating
    "nemotron": ("nemotron", "NemotronConfig", "NemotronForCausalLM", dict(
        BASE, norm_eps=1e-5, bos_token_id=None, eos_token_id=None)),
    # GPT-2 (Cerebras-GPT): learned absolute positions, Conv1D weights (q/k/v fused in c_attn's columns)
    "gpt2": ("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)),
    # DBRX: LayerNorms without bias, q/k/v fused in Wqkv and clamped (clip_qkv), experts in every layer
    # stored [E * F, H] (w1 / v1 / w2), top-k weights renormalised
    "dbrx": ("dbrx", "DbrxConfig", "DbrxForCausalLM", dict(
        vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=128, output_router_logits=True,
        attn_config=dict(kv_n_heads=2, clip_qkv=0.6, rope_theta=1000.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2, moe_loss_weight=0.1))),
}
# the switches whose removal must change the logits (they are not no-ops)
SWITCHED_OFF = {"seed_oss": [], "apertus": [], "hunyuan_v1_dense": [dict(qk_norm_after_rotary=False)],
                "falcon_7b": [], "falcon_40b": [], "falcon_seq": [], "granitemoeshared": [dict(experts_top_k=1)],
                "olmoe": [dict(experts_top_k=1), dict(norm_topk_prob=True)],
                "gemma": [dict(norm_offset=0.0), dict(scale_embeddings=False)],
                "glm": [dict(rotary_interleaved=False), dict(partial_rotary_factor=1.0)],
                "glm4": [dict(rotary_interleaved=False)],
                "ernie4_5": [dict(rotary_interleaved=False)],
                "gpt2": [], "dbrx": [dict(clip_qkv=None), dict(norm_topk_prob=False)], "starcoder2": [dict(sliding_window=None)], "nemotron": [dict(norm_offset=0.0),
                                                                      dict(partial_rotary_factor=1.0)]}
EAGER = dict(attn_implementation="eager", experts_implementation="eager")
MESH = fpp.Mesh(dp_shard=2, tp=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name, (_, conf, cls, kw) in FAMILIES.items():
        torch.manual_seed(0)
        model = getattr(transformers, cls)(getattr(transformers, conf)(**kw)).float().eval()
        with torch.no_grad():               # O(1) logits, non-trivial norms, biases and routers
            for n, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n.split(".")[-2] or ".ln_" in n else 0.1 * torch.randn_like(p))
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, safe_serialization=True)
        model.config._attn_implementation = "eager"
        if "moe" in name or name == "dbrx":           # (granitemoeshared, olmoe, dbrx)
            model.config._experts_implementation = "eager"
        out[name] = (model, d)
    return out


def test_configs_read_each_family(saved):
    cfg = hf.config_from_hf(saved["seed_oss"][1])
    assert (cfg.qkv_bias, cfg.o_bias, cfg.dim_head) == (True, True, 32)
    assert hf.config_from_hf(dict(BASE, model_type="seed_oss", attention_dropout=0.0, residual_dropout=0.0,
                                  attention_out_bias=False)).o_bias is False
    cfg = hf.config_from_hf(saved["apertus"][1])
    assert (cfg.mlp_gated, cfg.mlp_act, cfg.qk_norm, cfg.qk_norm_heads) == (False, "xielu", True, False)
    # ApertusConfig's rope where config.json has none: Llama 3 scaling of base 12e6
    cfg = hf.config_from_hf(dict(BASE, model_type="apertus", hidden_act="xielu"))
    assert (cfg.rope_theta, cfg.rope_scaling.factor) == (12e6, 8.0)
    cfg = hf.config_from_hf(saved["hunyuan_v1_dense"][1])
    assert (cfg.qk_norm, cfg.qk_norm_after_rotary, cfg.rope_scaling) == (True, True, None)
    assert cfg.rope_theta == pytest.approx(1000.0 * 10.0 ** (16 / 14))
    for name, kv, parallel_, two_norms, bias in (("falcon_7b", 1, True, False, False), ("falcon_40b", 2, True, True, True),
                                                 ("falcon_seq", 4, False, False, True)):
        cfg = hf.config_from_hf(saved[name][1])
        assert (cfg.kv_heads, cfg.parallel_block, cfg.parallel_mlp_norm, cfg.o_bias, cfg.mlp_bias, cfg.norm_bias) == (
            kv, parallel_, two_norms, bias, bias, True), name
    cfg = hf.config_from_hf(saved["granitemoeshared"][1])
    assert (cfg.experts, cfg.shared_expert_mlp, cfg.shared_expert_gate, cfg.norm_topk_prob) == (4, 48, False, True)
    assert "shared_expert_gate" not in llama.init(cfg)["layers"][0]["mlp"]
    assert llama.Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    cfg = hf.config_from_hf(saved["olmoe"][1])
    assert (cfg.experts, cfg.experts_top_k, cfg.moe_mlp, cfg.moe_layers, cfg.norm_topk_prob) == (4, 2, None, None, False)
    assert (cfg.qk_norm, cfg.qk_norm_heads, cfg.router_aux_loss_coef) == (True, True, 0.1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_logits_equal_transformers(saved, name):
    cfg, params, toks, want = import_logits_beside_hf(*saved[name])
    assert cfg.model_type == FAMILIES[name][0]
    for change in SWITCHED_OFF[name]:
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change


def _hf_grads(model, cfg, grads) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, ours, transformers') of every gradient of the in-memory transformers model (its
    experts fused: ``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F])."""
    ours = dict(tree.leaves_with_paths(grads))
    files = {n: parts for n, parts in hf._file_tensors(llama.init(cfg), cfg)}
    out = []
    for name, p in model.named_parameters():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):
            g = torch.cat([ours[f"layers.{layer}.mlp.{x}"].transpose(1, 2) for x in ("gate", "up")], dim=1)
        elif name.endswith("experts.down_proj"):
            g = ours[f"layers.{layer}.mlp.down"].transpose(1, 2)
        else:
            parts = files[name.replace("router.weight", "router.layer.weight")]
            g = hf.fuse_rows([kind.to_hf(ours[q]) for q, kind, _ in parts], cfg, getattr(parts[0][1], "row_axis", 0))
        out.append((name, g, p.grad))
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_loss_and_gradients_equal_transformers(saved, name):
    _, d = saved[name]
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    if cfg.experts:
        assert cfg.router_aux_loss_coef == 0.1
        want = want + 0.1 * out.aux_loss
    want.backward()
    # (transformers computes the rotary tables, and its router softmax, in fp32)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6 if cfg.experts else 1e-7, atol=0)
    got = _hf_grads(model, cfg, grads)
    assert len(got) == len(list(model.parameters()))
    for n, g, g0 in got:
        torch.testing.assert_close(g, g0, rtol=1e-5, atol=max(1e-6 * g0.abs().max().item(), 1e-8),
                                   msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fsdp_tp_equals_one_device(saved, name):
    """FSDP 2 x TP 2: each device reads its own shards of the files (Falcon's fused q/k/v: its
    heads' rows of each k/v group; the MoE's experts over dp_shard, EP) and its logits are its
    block of transformers'; the loss and every gradient equal one device's (fp64)."""
    model, d = saved[name]
    cfg, _ = hf.load_hf_llama(d)
    rules = llama.default_rules()
    if cfg.kv_heads == 1:                        # (multi-query: heads whole, tp splits the MLP and the vocabulary;
        rules = rules.replace(heads=None, kv_heads=None)        # Falcon-7B's 71 heads split no way)
    if cfg.experts:                              # expert parallelism over dp_shard, their mlp over tp
        rules = rules.replace(experts="dp_shard")
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits

    def device():
        with fpp.use_rules(rules):
            _, local = hf.load_hf_llama(d)
            with torch.no_grad():
                logits = settle(llama.forward(sharding.named_tree(local, llama.init(cfg)), fpp.named(toks, "batch seq"),
                                              cfg))
            region = block_slices(tuple(want.shape), logits.split, MESH, fpp.current_rank())
            torch.testing.assert_close(logits.data, want[region], atol=1e-5, rtol=1e-5)
    fpp.launch(device, MESH)
    _, full64 = hf.load_hf_llama(d, dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss0, grads0 = single_device(cfg, full64, batch)
    for rank, (loss, grads, _) in enumerate(parallel(cfg, full64, batch, MESH, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_round_trip_in_transformers(saved, tmp_path, name):
    mt, _, cls, _ = FAMILIES[name]
    assert_export_round_trip(saved[name][1], tmp_path / "out", mt, cls, **EAGER)


def test_refused_by_name(saved, tmp_path):
    # Seed-OSS's dropout: SeedOssConfig's 0.1 where config.json leaves it out; a rate outside [0, 1) refused
    cfg = hf.config_from_hf(dict(BASE, model_type="seed_oss"))
    assert (cfg.attention_dropout, cfg.residual_dropout) == (0.1, 0.1)
    for key in ("attention_dropout", "residual_dropout"):
        with pytest.raises(ck.CheckpointMismatchError, match=rf"HF seed_oss config: {key}=1.5 must be in \[0, 1\)"):
            hf.config_from_hf(dict(BASE, model_type="seed_oss", **{key: 1.5}))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF falcon config: alibi=True \(ALiBi"):
        hf.config_from_hf(dict(FALCON, model_type="falcon", alibi=True))
    # (transformers' sequential Falcon drops the attention's output at attention_dropout too: no site of ours)
    seq = dict(FAMILIES["falcon_seq"][3], model_type="falcon")
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF falcon config: attention_dropout=0.1 with sequential "
                                                         r"layers \(parallel_attn=False\) is not supported"):
        hf.config_from_hf(dict(seq, attention_dropout=0.1))
    assert hf.config_from_hf(dict(FALCON, model_type="falcon", attention_dropout=0.1)).attention_dropout == 0.1
    with pytest.raises(ck.CheckpointMismatchError, match=r"hidden_dropout=0.1 is not supported: transformers' Falcon"):
        hf.config_from_hf(dict(FALCON, model_type="falcon", hidden_dropout=0.1))
    with pytest.raises(ck.CheckpointMismatchError, match=r"new_decoder_architecture=True with parallel_attn=False"):
        hf.config_from_hf(dict(FALCON, model_type="falcon", new_decoder_architecture=True, parallel_attn=False))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF apertus config: hidden_act='silu' is not supported"):
        hf.config_from_hf(dict(BASE, model_type="apertus", hidden_act="silu"))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF qwen3_moe config: clip_qkv=8.0 is not supported"):
        hf.config_from_hf(dict(BASE, model_type="qwen3_moe", clip_qkv=8.0))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF qwen3_5 config: text_config is missing"):
        hf.config_from_hf(dict(BASE, model_type="qwen3_5"))
    with pytest.raises(ck.CheckpointMismatchError, match=r"model_type 'gemma3n_text' is not supported \(Gemma 3n: "
                                                         r"its layers carry per-layer input embeddings"):
        hf.config_from_hf(dict(BASE, model_type="gemma3n_text"))
    # DBRX's router jitter and other p-norms of the top-k weights; GPT-2's and StarCoder 2's dropouts
    dbrx = {k: v for k, v in FAMILIES["dbrx"][3].items() if k != "ffn_config"}
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF dbrx config: ffn_config.moe_jitter_eps=0.01 is not "
                                                         r"supported \(a deterministic router only"):
        hf.config_from_hf(dict(dbrx, model_type="dbrx", ffn_config=dict(moe_jitter_eps=0.01)))
    with pytest.raises(ck.CheckpointMismatchError, match=r"moe_normalize_expert_weights=2.0 is not supported"):
        hf.config_from_hf(dict(dbrx, model_type="dbrx", ffn_config=dict(moe_normalize_expert_weights=2.0)))
    gpt2 = {k: v for k, v in FAMILIES["gpt2"][3].items() if not k.endswith("pdrop")}
    read = hf.config_from_hf(dict(gpt2, model_type="gpt2"))           # (GPT2Config's default dropouts: 0.1)
    assert (read.attention_dropout, read.residual_dropout, read.embedding_dropout) == (0.1, 0.1, 0.1)
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF gpt2 config: scale_attn_by_inverse_layer_idx=True"):
        hf.config_from_hf(dict(FAMILIES["gpt2"][3], model_type="gpt2", scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF starcoder2 config: residual_dropout=1.5 must be in \[0, 1\)"):
        hf.config_from_hf(dict(BASE, model_type="starcoder2", residual_dropout=1.5))
    cfg = hf.config_from_hf(saved["gpt2"][1])         # (a table of 32 positions)
    with pytest.raises(ValueError, match=r"learned_positions: position 32 is past the position table's max_seq=32"):
        our_logits(fpp.init_params(llama.init(cfg), seed=0), cfg, torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"clip_qkv must be a positive number"):
        llama.Config.tiny(clip_qkv=0.0)
    with pytest.raises(ValueError, match=r"mlp_act='xielu' needs mlp_gated=False"):
        llama.Config.tiny(mlp_act="xielu")
    # export refuses what the class cannot hold, before writing anything
    cfg = hf.config_from_hf(saved["falcon_seq"][1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'falcon': kv_heads=2 has no FalconForCausalLM"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, kv_heads=2), tmp_path / "no")
    cfg = hf.config_from_hf(saved["granitemoeshared"][1])
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'granitemoeshared': shared_expert_gate=True"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, shared_expert_gate=True), tmp_path / "no")
    cfg = hf.config_from_hf(saved["dbrx"][1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'mistral': clip_qkv=0.6 has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="mixtral", norm_kind="rms"), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'dbrx': norm_kind='rms' has no DbrxForCausalLM"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, norm_kind="rms"), tmp_path / "no")
    cfg = hf.config_from_hf(saved["olmoe"][1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'olmoe': qk_norm_heads=False has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, qk_norm_heads=False), tmp_path / "no")
    assert not (tmp_path / "no").exists()
    # xIELU's beta and eps are constants of the files: another value is named
    from safetensors.torch import load_file, save_file
    d, bad = saved["apertus"][1], tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.1.mlp.act_fn.beta"] = torch.tensor(0.25)
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"model.layers.1.mlp.act_fn.beta: \[0.25\], but the "
                                                         r"functional decoder's is the constant 0.5"):
        hf.load_hf_llama(bad)


def test_new_options_train_alike_on_real_processes():
    """xIELU (its scalars' gradients summed over the devices that split ``mlp``), q/k norms
    after the rotary and DBRX's q/k/v clamp: two AdamW steps with TP 2 on two gloo processes
    equal one device; GPT-2's learned positions (each process's rows of the table) with CP 2; ERNIE 4.5's
    gate bias (split over ``mlp`` by TP 2) and interleaved rotary."""
    from harness import launch_steps
    cfg = llama.Config.tiny(mlp_gated=False, mlp_act="xielu", qk_norm=True, qk_norm_after_rotary=True, clip_qkv=0.1)
    gpt2 = llama.Config.tiny(learned_positions=True, norm_kind="layer", norm_bias=True, mlp_gated=False,
                             mlp_act="gelu_tanh", qkv_bias=True, o_bias=True, max_seq=16)
    ernie = llama.Config.tiny(qkv_bias=True, o_bias=True, mlp_bias=True, rotary_interleaved=True)
    for cfg, mesh, rules in ((cfg, fpp.Mesh(tp=2), llama.default_rules(fsdp=False)),
                             (ernie, fpp.Mesh(tp=2), llama.default_rules(fsdp=False)),
                             (gpt2, fpp.Mesh(cp=2), fpp.Rules(seq=fpp.balanced("cp"), res_seq=fpp.inherit("seq")))):
        one = launch_steps(cfg, dtype=torch.float64)[0]
        real = launch_steps(cfg, mesh=mesh, rules=rules, dtype=torch.float64, processes=True)
        trained = ("embed_positions" if cfg.learned_positions else "layers.0.mlp.gate_bias" if cfg.mlp_bias
                   else "layers.0.mlp.act_alpha_p")
        assert not np.array_equal(one[1][trained], launch_steps(cfg, dtype=torch.float64, steps=0)[0][1][trained])
        for losses, params, _ in real:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=1e-10, atol=0)
            for p, x in params.items():
                torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one[1][p]), rtol=1e-8, atol=1e-12,
                                           msg=lambda m: f"{p}: {m}")


def test_cli_trains_an_apertus_base_model_and_exports_it(saved, tmp_path):
    """``functional-pp train`` with base_model an Apertus directory on FSDP 2 x TP 2 (simulated):
    xIELU's scalars (parameters without dimensions) train, go through the sharded checkpoint,
    and the export writes them with the constant beta / eps buffers; transformers loads the
    Apertus class with logits equal to ours."""
    import yaml

    from functional_pp import cli
    d = saved["apertus"][1]
    conf = {"base_model": str(d), "micro_batch_size": 2, "global_batch_size": 4, "sequence_len": 16,
            "learning_rate": 1e-2, "warmup_steps": 0, "max_steps": 2, "data": {"max_bytes": 20_000},
            "logging": {"log_every": 1, "plot": False}, "dp_shard_size": 2, "tensor_parallel_size": 2}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(conf))
    assert cli.main(["train", str(tmp_path / "train.yaml"), "--simulate", "4", "--output", str(tmp_path / "run")]) == 0
    hf_dir = hf.export_checkpoint_to_hf(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **EAGER)
    assert type(model).__name__ == "ApertusForCausalLM"
    assert model.model.layers[0].mlp.act_fn.beta.item() == 0.5       # (the constant, not left uninitialised)
    cfg, params = hf.load_hf_llama(hf_dir)
    _, base = hf.load_hf_llama(d)
    assert not torch.equal(params["layers"][0]["mlp"]["act_alpha_p"], base["layers"][0]["mlp"]["act_alpha_p"])
    toks = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=toks).logits, our_logits(params, cfg, toks), atol=1e-5, rtol=1e-5)


def test_new_options_on_pipeline_stages():
    """xIELU's scalars and q/k norms after the rotary with the layers over pp = 2 (1F1B, four
    micro-batches): two AdamW steps give one device's losses (the second after an update of
    every parameter, the scalars' included)."""
    cfg = llama.Config.tiny(layers=4, mlp_gated=False, mlp_act="xielu", qk_norm=True, qk_norm_after_rotary=True)
    assert_1f1b_equals_one_device(cfg, lr=3e-2, rtol=1e-12, atol=1e-13)


def test_new_options_compiled_equal_eager():
    """xIELU, q/k norms after the rotary and a shared expert without a gate in a compiled step
    (aot_eager, the native trace) train as eager (the experts with a static capacity, as
    compiled MoE steps need; docs/experts.md)."""
    from harness import assert_same_run, launch_steps
    cfgs = (llama.Config.tiny(mlp_gated=False, mlp_act="xielu", qk_norm=True, qk_norm_after_rotary=True),
            llama.Config.tiny(experts=4, experts_top_k=2, shared_expert_mlp=32, shared_expert_gate=False,
                              capacity_factor=4.0))       # (a static capacity: the experts compile)
    try:
        for cfg in cfgs:
            opt = fpp.optim.adamw(1e-2)
            assert_same_run(launch_steps(cfg, "aot_eager", batch=2, opt=opt, loss_as_traced=True)[0],   # (both:
                            launch_steps(cfg, False, batch=2, opt=opt, loss_as_traced=True)[0],   # the loss as
                            rtol=1e-5, atol=1e-7)                                                  # traced)
    finally:
        torch._dynamo.reset()
