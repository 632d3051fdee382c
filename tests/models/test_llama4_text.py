"""Llama 4 (text, ``llama4_text``) as a configuration of the one decoder (models/llama.py,
models/moe.py, models/llama4_hf.py): chunked attention in the rotating layers, NoPE layers with
attention temperature tuning, the weightless q/k RMSNorm, the interleaved rotary, experts in
every second layer (a shared expert added as it is, top-1 sigmoid routing that scales each
expert's input) and dense layers of ``intermediate_size_mlp``. A tiny random model transformers
builds from a config loads through the HF import; logits, loss and every gradient equal
transformers'; export writes ``Llama4ForCausalLM``, which loads with equal logits; EP x TP and CP
on simulated devices and TP on real gloo processes equal one device."""
import dataclasses
import json

import pytest
import torch
from harness import assert_export_round_trip, make_batch, our_logits, parallel, single_device, tokens, fp64_beside_hf

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")

# chunks and a temperature floor shorter than the 12-token sequences, so that they act
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
              interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=3, attn_scale=0.5,
              no_rope_layer_interval=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
              max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 100.0})
EAGER = dict(attn_implementation="eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**CONFIG)).float().eval()
    with torch.no_grad():              # O(1) logits, routers far from uniform
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("llama4_text")
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = "eager"
    return model, d


def test_config_reads_llama4_text(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.experts, cfg.experts_top_k, cfg.moe_layers, cfg.moe_mlp, cfg.mlp) == (
        "llama4_text", 4, 1, (1, 3), 32, 96)
    assert (cfg.shared_expert_mlp, cfg.shared_expert_gate, cfg.router_score, cfg.experts_scale_input) == (
        32, False, "sigmoid", True)
    assert (cfg.nope_layers, cfg.attention_chunk, cfg.layer_types[:2], cfg.qk_l2_norm, cfg.rotary_interleaved) == (
        (1, 3), 4, ("chunked_attention", "full_attention"), True, True)
    assert (cfg.attn_temperature_floor, cfg.attn_temperature_scale) == (3.0, 0.5)


def test_import_logits_equal_transformers(saved):
    model, d = saved
    cfg, params = hf.load_hf_llama(d)
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    assert want.abs().max() > 0.5
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
    # each Llama 4 option changes the result (so the equality above covers it)
    for change in (dict(layer_types=None, attention_chunk=None), dict(qk_l2_norm=False),
                   dict(attn_temperature_floor=None), dict(experts_scale_input=False), dict(rotary_interleaved=False)):
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change


def _hf_grad(ours: dict, name: str) -> torch.Tensor:
    """Our gradient of transformers' in-memory parameter ``name``, in its layout."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    m = f"layers.{layer}.mlp"
    if name.endswith("experts.gate_up_proj"):
        return torch.cat([ours[f"{m}.gate"], ours[f"{m}.up"]], -1)
    if name.endswith("experts.down_proj"):
        return ours[f"{m}.down"]
    if name.endswith("router.weight"):
        return ours[f"{m}.router"].T
    path = hf.our_path(name.replace(".feed_forward.", ".mlp."))
    return hf.KINDS[hf.hf_kind(path, "llama4_text")].to_hf(ours[path])


def test_loss_and_gradients_equal_transformers(saved):
    _, d = saved
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    for name, p in model.named_parameters():
        torch.testing.assert_close(_hf_grad(ours, name), p.grad, rtol=1e-4, atol=1e-6 * p.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "llama4_text", "Llama4ForCausalLM", **EAGER)


@pytest.mark.parametrize("layout", ["ep_tp", "cp"])
def test_layouts_equal_one_device(saved, layout):
    """EP x TP (the experts over dp_shard, heads, kv_heads, the experts' mlp and the vocabulary
    over tp) and CP (the chunks and the temperature over the load-balanced split sequence)."""
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss, grads = single_device(cfg, params, batch)
    mesh, rules = ((fpp.Mesh(dp_shard=2, tp=2), Rules(batch="dp_shard", experts="dp_shard", heads="tp",
                                                      kv_heads="tp", vocab="tp", mlp="tp"))
                   if layout == "ep_tp" else (fpp.Mesh(cp=2), llama.default_rules(tp=False)))
    p_loss, p_grads, _ = parallel(cfg, params, batch, mesh, rules)[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def test_tp_on_real_processes_equals_one_device(saved):
    """Two AdamW steps with TP 2 on two real gloo processes equal one device."""
    from harness import assert_processes_equal_one_device
    assert_processes_equal_one_device(hf.config_from_hf(saved[1]), fpp.Mesh(tp=2), llama.default_rules(fsdp=False))


def test_refusals_name_the_option(saved, tmp_path):
    conf = json.loads((saved[1] / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF llama4_text config: router_jitter_noise=0.1"):
        hf.config_from_hf(dict(conf, router_jitter_noise=0.1))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF llama4 config: text_config=None is not supported: "
                                                         r"config.json has no text_config"):
        hf.config_from_hf(dict(conf, model_type="llama4"))      # (the multimodal one: its text_config is read)
    cfg = hf.config_from_hf(saved[1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'llama4_text': experts_scale_input=False has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, experts_scale_input=False), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'llama': attention_chunk=4 has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="llama", experts=0), tmp_path / "no")
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match=r"layer_types marks chunked_attention layers but attention_chunk is not set"):
        dataclasses.replace(cfg, attention_chunk=None)
    with pytest.raises(ValueError, match=r"experts_scale_input with capacity_factor is not supported"):
        dataclasses.replace(cfg, capacity_factor=2.0)
