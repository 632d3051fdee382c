"""GLM-5 (``glm_moe_dsa``): DeepSeek sparse attention (the latent attention plus the lightning
indexer, models/dsa.py: each query attends to its ``index_topk`` best-scored earlier keys) with
DeepSeek-V3's experts, as a configuration of the one decoder. A tiny random model built by
``transformers`` (index_topk 4, so rows of 12 and 16 tokens are sparse and rows of 3 dense) loads
through the HF import; logits, the fp64 loss and every gradient equal transformers' (the indexer
gets none there, under ``torch.no_grad``, nor here); packed documents, export, LoRA = peft; FSDP x
TP and EP x TP on simulated devices and EP x FSDP on real gloo processes equal one device;
context parallelism and 'shared' indexer layers are refused by name."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from harness import (assert_export_round_trip, assert_lora_step_equals_peft, assert_processes_equal_one_device, make_batch, our_logits, parallel, single_device, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")

CONF = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            rms_norm_eps=1e-5, max_position_embeddings=128, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
            index_topk=4, index_n_heads=4, index_head_dim=16, routed_scaling_factor=2.5)
EAGER = dict(attn_implementation="eager", experts_implementation="eager")
# DeepSeek-V3.2: the same layer, the indexer's rotary on halves, DeepSeek-V3's grouped router
FAMILIES = {"glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {}),
            "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(n_group=4, topk_group=2))}


def _build(tmp, family="glm_moe_dsa", **more):
    conf, cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, conf)(**{**CONF, **kw, **more})).float().eval()
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
    d = tmp_path_factory.mktemp("glm_moe_dsa")
    return _build(d), d


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek_v32")
    return _build(d, "deepseek_v32"), d


def test_config_reads_the_indexer(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.index_topk, cfg.index_heads, cfg.index_head_dim, cfg.index_rotary_interleaved,
            cfg.rotary_interleaved, cfg.kv_lora_rank, cfg.moe_layers) == ("glm_moe_dsa", 4, 4, 16, True, True, 16, (1,))
    a = llama.init(cfg)["layers"][0]["self_attn"]
    assert a["indexer_wq_b"].shape == (24, 4, 16) and a["indexer_weights_proj"].shape == (64, 4)
    assert llama.Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("seq", [12, 3], ids=["longer_than_topk", "shorter_than_topk"])
def test_logits_equal_transformers(saved, seq):
    model, d = saved
    cfg, params = hf.load_hf_llama(d)
    toks = tokens(seq=seq)
    with torch.no_grad():
        want = model(input_ids=toks).logits
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
    dense = our_logits(params, dataclasses.replace(cfg, index_topk=1000), toks)
    halves = our_logits(params, dataclasses.replace(cfg, index_rotary_interleaved=False), toks)
    if seq > cfg.index_topk:           # (the top-k, and which keys it picks, matter only once it bites)
        assert not torch.allclose(dense, want, atol=1e-3) and not torch.allclose(halves, want, atol=1e-3)
    else:
        torch.testing.assert_close(dense, want, atol=1e-5, rtol=1e-5)


def _hf_grad(ours: dict, name: str, cfg) -> torch.Tensor:
    """Our gradient of transformers' parameter ``name`` (its experts fused as there)."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("experts.gate_up_proj"):
        g, u = ours[f"layers.{layer}.mlp.gate"], ours[f"layers.{layer}.mlp.up"]
        return torch.cat([g.transpose(1, 2), u.transpose(1, 2)], dim=1)
    if name.endswith("experts.down_proj"):
        return ours[f"layers.{layer}.mlp.down"].transpose(1, 2)
    files = dict(hf._file_tensors(llama.init(cfg), cfg))
    return torch.cat([kind.to_hf(ours[p]) for p, kind, _ in files[name]])


def test_loss_and_gradients_equal_transformers(saved):
    _, d = saved
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, **EAGER)
    cfg, params = hf.load_hf_llama(d, dtype=torch.float64)
    batch = make_batch(cfg, batch=3, seq=12, seed=2)
    loss, grads = single_device(cfg, params, batch)
    logits = model(input_ids=batch["tokens"]).logits
    want = F.cross_entropy(logits.reshape(-1, cfg.vocab), batch["labels"].reshape(-1))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    indexer = [n for n, p in model.named_parameters() if ".indexer." in n]
    assert len(indexer) == 10 and all(model.get_parameter(n).grad is None for n in indexer)
    assert all(g is None or not g.any() for p, g in ours.items() if ".indexer_" in p)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(_hf_grad(ours, name, cfg), p.grad.double(), rtol=1e-4,
                                   atol=1e-5 * p.grad.abs().max().item(), msg=lambda m: f"{name}: {m}")


def test_packed_documents_equal_transformers(saved):
    """Packed rows (two documents each): equal transformers given the block-diagonal causal mask
    and positions restarting per document (its indexer then ranks the same rows of 12 keys; a
    document alone may differ where keys tie at the k-th place, e.g. scores exactly 0 after the
    ReLU, which torch.topk breaks by the row it sees)."""
    model, d = saved
    cfg, params = hf.load_hf_llama(d)
    toks, seg = tokens(batch=2, seq=12), torch.tensor([[0] * 5 + [1] * 7, [3] * 9 + [4] * 3])
    pos = torch.tensor([list(range(5)) + list(range(7)), list(range(9)) + list(range(3))])
    got = llama.forward(sharding.named_tree(params, llama.init(cfg)), fpp.wrap(toks, "batch seq"), cfg,
                        segments=fpp.wrap(seg, "batch seq")).value()
    seen = (seg[:, :, None] == seg[:, None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    mask = torch.zeros(2, 1, 12, 12).masked_fill(~seen[:, None], torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model(input_ids=toks, position_ids=pos, attention_mask={"indexed_attention": mask}).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got[0, 5:], model(input_ids=toks[:1]).logits[0, 5:], atol=1e-3)


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "glm_moe_dsa", "GlmMoeDsaForCausalLM", **EAGER)


def test_deepseek_v32_equals_transformers(v32, tmp_path):
    """DeepSeek-V3.2 (the same sparse attention, its indexer's rotary on halves): logits and the
    exported checkpoint equal transformers'."""
    model, d = v32
    cfg, params = hf.load_hf_llama(d)
    assert (cfg.model_type, cfg.index_rotary_interleaved, cfg.router_groups) == ("deepseek_v32", False, 4)
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, index_rotary_interleaved=True), toks), want,
                              atol=1e-3)
    assert_export_round_trip(d, tmp_path / "out", "deepseek_v32", "DeepseekV32ForCausalLM", **EAGER)


def test_lora_on_the_latent_attention_equals_peft(tmp_path):
    pytest.importorskip("peft")
    assert_lora_step_equals_peft(_build(tmp_path), tmp_path,
                                 ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))


MESH = fpp.Mesh(dp_shard=2, tp=2)


@pytest.mark.parametrize("rules", [
    llama.default_rules(),                                                                   # FSDP x TP
    fpp.Rules(batch="dp_shard", experts="dp_shard", heads="tp", kv_heads="tp", vocab="tp", mlp="tp")],   # EP x TP
    ids=["fsdp_tp", "ep_tp"])
def test_layouts_equal_one_device(saved, rules):
    cfg, full64 = hf.load_hf_llama(saved[1], dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss0, grads0 = single_device(cfg, full64, batch)
    for rank, (loss, grads, _) in enumerate(parallel(cfg, full64, batch, MESH, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            if g0 is None:                 # (the indexer, the router's score correction: no gradient)
                continue
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


def test_sparse_attention_trains_alike_on_real_processes():
    """Two AdamW steps of a DSA model (rows of 16, top-k 4) with the experts split over the batch's
    axis and FSDP, on two gloo processes, equal one device."""
    cfg = llama.Config.tiny(kv_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                            v_head_dim=16, rotary_interleaved=True, experts=4, experts_top_k=2, moe_mlp=16,
                            shared_expert_mlp=16, shared_expert_gate=False, router_score="sigmoid", router_bias=True,
                            routed_scaling_factor=2.5, norm_topk_prob=True, moe_layers=(1,), index_topk=4,
                            index_heads=2, index_head_dim=8, model_type="glm_moe_dsa")
    assert_processes_equal_one_device(cfg, fpp.Mesh(dp_shard=2),
                                      fpp.Rules(batch="dp_shard", experts="dp_shard", hidden="dp_shard"))


def test_refusals_name_the_setting(saved):
    cfg, full = hf.load_hf_llama(saved[1], dtype=torch.float64)
    with pytest.raises(Exception, match=r"DeepSeek sparse attention \(index_topk=4\) with the sequence split over "
                                         r"\('cp',\) \(context parallelism\) is not supported"):
        parallel(cfg, full, make_batch(cfg, batch=2, seq=12), fpp.Mesh(cp=2), fpp.Rules(seq="cp"))
    conf = json.loads((saved[1] / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"indexer_types .* is not supported: only 'full' in every "
                                                         r"layer"):
        hf.config_from_hf(dict(conf, indexer_types=["full", "shared"]))
    with pytest.raises(ValueError, match=r"index_topk=4 \(DeepSeek sparse attention\) needs .* a q latent"):
        dataclasses.replace(cfg, q_lora_rank=None)


def test_context_parallelism_is_refused_before_training(saved):
    """A training config with cp_size 2 for a sparse-attention model: refused by name at the check
    of the world, before any model is built."""
    from functional_pp.config import ConfigError, TrainConfig
    from functional_pp.config.checks import check_world
    cfg = TrainConfig.from_dict({"base_model": str(saved[1]), "cp_size": 2, "sequence_len": 16})
    with pytest.raises(ConfigError, match=r"cp_size 2: the model's DeepSeek sparse attention \(index_topk=4"):
        check_world(cfg, 2)
