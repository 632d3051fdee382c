"""Arcee AFMoE (Trinity) as a configuration of the one decoder (models/llama.py, models/moe.py,
models/afmoe_hf.py): per-head q/k norms, the attention's output gate (``attn_gate``), sliding layers
with the rotary and full layers without (``nope_layers``), norms before and after attention and the
MLP, a dense first layer, then sigmoid routing with a choosing bias, renormalised and scaled top-k
weights, shared experts, and muP's scaled embedding. A tiny random model transformers builds from a
config loads through the HF import; logits, loss and every gradient equal transformers'; export
writes ``AfmoeForCausalLM``, which loads with equal logits; EP x TP and CP x TP on simulated devices and FSDP x
TP on real gloo processes equal one device; what the class cannot hold is refused by name."""
import dataclasses
import json

import pytest
import torch
from harness import assert_export_round_trip, fp64_beside_hf, make_batch, our_logits, parallel, single_device, tokens, import_logits_beside_hf

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.models import llama, llama_hf

transformers = pytest.importorskip("transformers")

# windows shorter than the 12-token sequences; sliding / full layers alternating; one dense layer first
CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_dense_layers=1, num_experts=4,
              num_experts_per_tok=2, num_shared_experts=2, route_scale=1.5, global_attn_every_n_layers=2,
              sliding_window=5, max_position_embeddings=128, mup_enabled=True, pad_token_id=None, eos_token_id=None,
              bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.AfmoeForCausalLM(transformers.AfmoeConfig(**CONFIG)).float().eval()
    with torch.no_grad():              # O(1) logits, routers far from uniform, an expert bias that changes choices
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else
                    0.5 * torch.randn_like(p) if "expert_bias" in name else 0.2 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("afmoe")
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = model.config._experts_implementation = "eager"
    return model, d


def test_config_reads_afmoe(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.experts, cfg.experts_top_k, cfg.moe_mlp, cfg.shared_expert_mlp) == ("afmoe", 4, 2, 16, 32)
    assert (cfg.router_score, cfg.router_bias, cfg.norm_topk_prob, cfg.routed_scaling_factor,
            cfg.shared_expert_gate) == ("sigmoid", True, True, 1.5, False)
    assert (cfg.attn_gate, cfg.qk_norm, cfg.sandwich_norms, cfg.scale_embeddings, cfg.moe_layers) == (
        True, True, True, True, (1, 2, 3))
    assert (cfg.sliding_window, cfg.nope_layers) == (5, (1, 3))
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    # AfmoeConfig's defaults where config.json leaves keys out: every 4th layer full, no rotary there
    conf = json.loads((saved[1] / "config.json").read_text())
    bare = hf.config_from_hf({k: v for k, v in conf.items() if k not in ("layer_types", "global_attn_every_n_layers",
                                                                         "rope_parameters", "mup_enabled")})
    assert (bare.nope_layers, bare.rope_theta, bare.scale_embeddings) == ((3,), 10000.0, False)


def test_import_logits_equal_transformers(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved)
    # each AFMoE option changes the result (so the equality above covers it)
    for change in (dict(nope_layers=None), dict(scale_embeddings=False), dict(routed_scaling_factor=1.0),
                   dict(layer_types=None, sliding_window=None, nope_layers=None)):
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change
    ungated = tree.tree_map(lambda x: x, params)
    for layer in ungated["layers"]:
        layer["self_attn"] = {k: v for k, v in layer["self_attn"].items() if k != "gate_proj"}
    assert not torch.allclose(our_logits(ungated, dataclasses.replace(cfg, attn_gate=False), toks), want, atol=1e-3)
    unbiased = tree.tree_map(lambda x: x, params)
    for layer in unbiased["layers"][1:]:
        layer["mlp"]["router_bias"] = torch.zeros_like(layer["mlp"]["router_bias"])
    assert not torch.allclose(our_logits(unbiased, cfg, toks), want, atol=1e-3)


def _hf_grad(ours: dict, name: str, cfg) -> torch.Tensor:
    """Our gradient of transformers' in-memory parameter ``name``, in its layout."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    m = f"layers.{layer}.mlp"
    if name.endswith("experts.gate_up_proj"):             # [E, 2F, H]: gate, then up
        return torch.cat([ours[f"{m}.gate"].transpose(1, 2), ours[f"{m}.up"].transpose(1, 2)], 1)
    if name.endswith("experts.down_proj"):                # [E, H, F]
        return ours[f"{m}.down"].transpose(1, 2)
    by_file = {llama_hf.file_name(p, "afmoe", cfg)[0]: p for p in ours}
    path = by_file[name]
    return hf.KINDS[hf.hf_kind(path, "afmoe")].to_hf(ours[path])


def test_loss_and_gradients_equal_transformers(saved):
    _, d = saved
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    want.backward()
    # (transformers' router is float32 even in a float64 model; ours is float64)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    checked = 0
    for name, p in model.named_parameters():
        if "expert_bias" in name:                         # not trained (requires_grad False): ours is 0
            assert p.grad is None and not ours[f"layers.{name.split('.')[2]}.mlp.router_bias"].any()
            continue
        torch.testing.assert_close(_hf_grad(ours, name, cfg), p.grad.double(), rtol=1e-4,
                                   atol=1e-5 * p.grad.abs().max().item(), msg=lambda m: f"{name}: {m}")
        checked += 1
    moe = len(cfg.moe_layers)                               # (one gate_up_proj per gate + up; router_bias apart)
    assert checked == len(ours) - 2 * moe and any("self_attn.gate_proj" in n for n, _ in model.named_parameters())


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "afmoe", "AfmoeForCausalLM", **EAGER)


def test_expert_and_tensor_parallel_equal_one_device(saved):
    """EP x TP on simulated devices: the experts over dp_shard, heads (and the attention's gate),
    kv_heads, the MLPs' mlp and the vocabulary over tp."""
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss, grads = single_device(cfg, params, batch)
    rules = Rules(batch="dp_shard", experts="dp_shard", heads="tp", kv_heads="tp", vocab="tp", mlp="tp")
    p_loss, p_grads, _ = parallel(cfg, params, batch, fpp.Mesh(dp_shard=2, tp=2), rules)[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def test_context_and_tensor_parallel_equal_one_device(saved):
    """CP x TP on simulated devices: the windows, the NoPE full layers and the attention's gate
    over each device's part of the sequence (load-balanced), heads over tp."""
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    batch = make_batch(cfg, batch=2, seq=12, seed=4)
    loss, grads = single_device(cfg, params, batch)
    p_loss, p_grads, _ = parallel(cfg, params, batch, fpp.Mesh(dp_shard=1, cp=2, tp=2), llama.default_rules())[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def test_fsdp_tp_on_real_processes_equal_one_device(saved):
    """Two AdamW steps with FSDP x TP on four real gloo processes (the attention's gate split over
    tp, hidden over dp_shard) equal one device."""
    from harness import assert_processes_equal_one_device
    assert_processes_equal_one_device(hf.config_from_hf(saved[1]))


def test_refusals_name_the_option(saved, tmp_path):
    conf = json.loads((saved[1] / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF afmoe config: hidden_act='gelu' is not supported"):
        hf.config_from_hf(dict(conf, hidden_act="gelu"))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF afmoe config: sliding_window=None with sliding_attention"):
        hf.config_from_hf(dict(conf, sliding_window=None))
    cfg = hf.config_from_hf(saved[1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'afmoe': nope_layers=None has no "
                                                         r"AfmoeForCausalLM equivalent \(it needs \(1, 3\)\)"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, nope_layers=None), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'afmoe': attn_gate=False has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, attn_gate=False), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'glm4_moe': attn_gate=True has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="glm4_moe", sandwich_norms=False,
                                                     scale_embeddings=False, nope_layers=None), tmp_path / "no")
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match=r"attn_gate with latent attention"):
        llama.Config.preset("deepseek-v3", attn_gate=True)
