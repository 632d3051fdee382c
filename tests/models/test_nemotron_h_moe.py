"""Nemotron 3's mixture-of-experts layers (``moe`` in ``layers_block_type``, ``E`` in the pattern)
of ``nemotron_h`` (models/nemotron_h_hf.py, models/moe.py, ops/experts.py ``gate=None``): squared-ReLU
experts not gated, DeepSeek-V3's sigmoid router with its score correction, groups, renormalised and
scaled top-k weights, a squared-ReLU shared expert. A tiny random model transformers builds
(Mamba2, MoE, attention, MoE layers) loads through the HF import (the experts one tensor each in
the files, stacked in ours); logits, the fp64 loss and every gradient equal transformers'; export
writes ``NemotronHForCausalLM`` with equal logits; FSDP x TP + SP and EP (borrowing dp_shard, and
over ``ep`` x FSDP) on simulated devices and EP x FSDP on real gloo processes equal one device;
Nemotron 3 Super's latent experts (``moe_latent_size``) equal transformers and one device too."""
import pytest
import torch
from harness import (assert_export_round_trip, assert_hf_layout_equals_one_device, assert_processes_equal_one_device,
                     fp64_beside_hf, hf_scan_in_fp64, import_logits_beside_hf, make_batch, parallel, single_device)

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronHForCausalLM"):
    pytest.skip("transformers without Nemotron-H", allow_module_level=True)

# Mamba2, MoE (8 experts in 4 groups, top-2 of the best 2 groups), attention, MoE
CONFIG = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              layers_block_type=["linear_attention", "moe", "full_attention", "moe"], intermediate_size=48,
              mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=4,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
              moe_shared_expert_intermediate_size=24, n_group=4, topk_group=2, norm_topk_prob=True,
              routed_scaling_factor=2.5, time_step_limit=(0.0, 2.0), pad_token_id=None, bos_token_id=None,
              eos_token_id=None)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _tiny(tmp_path_factory, CONFIG)


@pytest.fixture(scope="module")
def latent_dir(tmp_path_factory):
    """Nemotron 3 Super's latent experts: on fc1_latent_proj(x) of width 16, summed through fc2_latent_proj."""
    return _tiny(tmp_path_factory, {**CONFIG, "moe_latent_size": 16,
                                    "layers_block_type": ["full_attention", "moe", "moe"]})


def _tiny(tmp_path_factory, config):
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**config))
    with torch.no_grad():                       # the scan's, the norms', the experts' and the score correction off init
        for n, p in model.named_parameters():
            if n.endswith(("A_log", "D", "dt_bias", "conv1d.bias")) or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
            if "experts" in n or "gate.weight" in n or "latent_proj" in n or n.startswith("lm_head"):
                p.copy_(0.2 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    out = tmp_path_factory.mktemp("nemotron_h_moe")
    model.save_pretrained(out)
    return out


def test_config_and_files_read(hf_dir):
    cfg, params = hf.load_hf_llama(hf_dir)
    assert cfg.layer_blocks == ("mamba2", "mlp", "attention", "mlp") and cfg.moe_layers == (1, 3)
    assert (cfg.experts, cfg.experts_top_k, cfg.moe_mlp, cfg.shared_expert_mlp) == (8, 2, 16, 24)
    assert (cfg.router_score, cfg.router_bias, cfg.router_groups, cfg.router_topk_groups) == ("sigmoid", True, 4, 2)
    assert cfg.routed_scaling_factor == 2.5 and not cfg.mlp_gated and cfg.mlp_act == "relu2"
    m = params["layers"][1]["mlp"]
    assert "gate" not in m and m["up"].shape == (8, 32, 16) and m["down"].shape == (8, 16, 32)
    assert set(m["shared_expert"]) == {"up_proj", "down_proj"} and "router_bias" in m


def test_logits_equal_transformers(hf_dir):
    model = transformers.NemotronHForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    import_logits_beside_hf(model, hf_dir)


def test_fp64_loss_and_every_gradient_equal_transformers(hf_dir, tmp_path, monkeypatch):
    _assert_fp64_gradients_equal(hf_dir, tmp_path, monkeypatch)


def _assert_fp64_gradients_equal(hf_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    # transformers keeps the router's weight in float32 and computes it there (.type(torch.float32)):
    # computed in float64 here, an oracle to fp64 rounding (the weight's gradient kept in float32)
    real_type = torch.Tensor.type
    monkeypatch.setattr(torch.Tensor, "type", lambda t, *a, **kw: real_type(t, torch.float64) if a == (torch.float32,)
                        else real_type(t, *a, **kw))
    with hf_scan_in_fp64():
        model, cfg, loss, grads, out, want = fp64_beside_hf(hf_dir, "NemotronHForCausalLM", experts_implementation="eager")
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    want.backward()
    for i in cfg.moe_layers:                                                 # (a buffer in transformers)
        grads["layers"][i]["mlp"]["router_bias"] = torch.zeros(8, dtype=torch.float64)
    hf.save_hf_llama(grads, cfg, tmp_path / "grads")
    ours = {k: v for k, v in load_file(str(tmp_path / "grads" / "model.safetensors")).items()
            if not k.endswith("e_score_correction_bias")}
    theirs = {}
    for n, p in model.named_parameters():
        n = n.replace("model.", "backbone.", 1)
        if n.endswith(("experts.up_proj", "experts.down_proj")):      # stacked in transformers, one per expert in files
            for j in range(p.shape[0]):
                theirs[n.replace("experts.", f"experts.{j}.") + ".weight"] = p.grad[j]
        else:
            theirs[n] = p.grad
    assert set(ours) == set(theirs)
    for name, g in ours.items():
        fp32 = name.endswith("gate.weight")
        torch.testing.assert_close(g, theirs[name].to(g.dtype), rtol=1e-6 if fp32 else 1e-8, atol=1e-9 if fp32 else 1e-11,
                                   msg=lambda m, name=name: f"{name}: {m}")
    i = cfg.moe_layers[0]
    assert all(theirs[f"backbone.layers.{i}.mixer.{k}"].abs().max() > 0 for k in ("gate.weight", "experts.0.up_proj.weight"))


def test_export_round_trip(hf_dir, tmp_path):
    assert_export_round_trip(hf_dir, tmp_path / "out", "nemotron_h", "NemotronHForCausalLM")


def test_fsdp_tp_sp_equals_one_device(hf_dir):
    assert_hf_layout_equals_one_device(hf_dir, "fsdp_tp_sp")


@pytest.mark.parametrize("layout", ["ep_borrows_dp_shard", "ep_axis_x_fsdp"])
def test_expert_parallel_equals_one_device(hf_dir, layout):
    mesh, rules = {"ep_borrows_dp_shard": (fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", experts="dp_shard")),
                   "ep_axis_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2),
                                      fpp.Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard"))}[layout]
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss, grads = single_device(cfg, params, batch)
    results = parallel(cfg, params, batch, mesh, rules)
    for p_loss, p_grads, rep in results:
        torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
        for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m, path=path: f"{path}: {m}")
    assert results[0][2].bytes("all_to_all") > 0                 # the tokens dispatched to their experts


def test_expert_parallel_x_fsdp_real_processes_equal_one_device(hf_dir):
    assert_processes_equal_one_device(hf.config_from_hf(hf_dir), mesh=fpp.Mesh(ep=2),
                                      rules=fpp.Rules(batch="ep", experts="ep", hidden="ep"))


def test_latent_experts_equal_transformers_and_one_device(latent_dir, tmp_path, monkeypatch):
    """Nemotron 3 Super's latent experts: the logits, the fp64 loss and every gradient equal
    transformers'; export round trip; EP x FSDP on simulated devices equals one device."""
    cfg, params = hf.load_hf_llama(latent_dir)
    assert cfg.moe_latent == 16 and params["layers"][1]["mlp"]["up"].shape == (8, 16, 16)
    assert params["layers"][1]["mlp"]["latent_in"].shape == (32, 16)
    model = transformers.NemotronHForCausalLM.from_pretrained(latent_dir, dtype=torch.float32)
    import_logits_beside_hf(model, latent_dir)
    _assert_fp64_gradients_equal(latent_dir, tmp_path, monkeypatch)
    monkeypatch.undo()
    assert_export_round_trip(latent_dir, tmp_path / "out", "nemotron_h", "NemotronHForCausalLM")
    cfg, params = hf.load_hf_llama(latent_dir, dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss, grads = single_device(cfg, params, batch)
    rules = fpp.Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard", latent="dp_shard")
    for p_loss, p_grads, _ in parallel(cfg, params, batch, fpp.Mesh(dp_shard=2, ep=2), rules):
        torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
        for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m, path=path: f"{path}: {m}")


def test_flops_count_the_experts_not_gated_and_latent(hf_dir, latent_dir):
    """A MoE layer's forward FLOPs per token: the router, top-k experts of two matrices (not gated)
    on the latent width, the latent projections and the shared expert."""
    import dataclasses

    from functional_pp.models import llama
    cfg = hf.config_from_hf(latent_dir)                           # attention, moe, moe
    dense = dataclasses.replace(cfg, layer_blocks=("attention", "attention", "attention"), moe_layers=None,
                                experts=0, moe_latent=0, experts_top_k=1)
    H, L, E, k, F, S = 32, 16, 8, 2, 16, 24
    moe_layer = 2 * H * E + 2 * 2 * L * k * F + 2 * 2 * H * L + 2 * 2 * H * S
    want = llama.flops_per_token(dense, 12) / 3 + 2 * moe_layer - 2 * (llama.flops_per_token(dense, 12) / 3
                                                                       - 2 * H * cfg.vocab) / 3
    assert llama.flops_per_token(cfg, 12) == pytest.approx(3 * want)
