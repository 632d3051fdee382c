"""gpt-oss as a configuration of the one decoder (models/llama.py, models/moe.py,
models/gpt_oss_hf.py): attention sinks, sliding / full layers alternating, biased q/k/v/o, a
biased router, biased experts with the clamped SwiGLU and gate / up alternating in
``gate_up_proj``, YaRN rope. A tiny random model transformers builds from a config loads through
the HF import; logits, loss and every gradient equal transformers'; export writes
``GptOssForCausalLM``, which loads with equal logits; EP x TP on simulated devices and FSDP x
TP on real gloo processes equal one device; what the class cannot hold is refused by name."""
import dataclasses
import json

import pytest
import torch
from harness import assert_export_round_trip, make_batch, our_logits, parallel, single_device, tokens, fp64_beside_hf, import_logits_beside_hf

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")

# windows shorter than the 12-token sequences; a small swiglu_limit so that the clamps act; YaRN
# with a factor whose attention factor changes the result
CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
              max_position_embeddings=128, swiglu_limit=0.8, pad_token_id=None, eos_token_id=None, bos_token_id=None,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 1000.0})
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).float().eval()
    with torch.no_grad():              # O(1) logits, routers far from uniform, sinks and biases that act
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else
                    torch.randn_like(p) if "sinks" in name else 0.2 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = model.config._experts_implementation = "eager"
    return model, d


def test_config_reads_gpt_oss(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.experts, cfg.experts_top_k, cfg.norm_topk_prob, cfg.moe_bias, cfg.attn_sinks) == (
        "gpt_oss", 4, 2, True, True, True)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.swiglu_limit, cfg.swiglu_alpha) == (True, True, 0.8, 1.702)
    assert (cfg.sliding_window, cfg.layer_types) == (5, ("sliding_attention", "full_attention"))
    assert isinstance(cfg.rope_scaling, llama.YarnScaling) and not cfg.rope_scaling.truncate
    # GptOssConfig's defaults where config.json leaves keys out
    bare = hf.config_from_hf({k: v for k, v in json.loads((saved[1] / "config.json").read_text()).items()
                              if k not in ("rope_parameters", "layer_types", "swiglu_limit")})
    assert (bare.swiglu_limit, bare.rope_theta, bare.rope_scaling.factor, bare.layer_types) == (
        7.0, 150000.0, 32.0, ("sliding_attention", "full_attention"))


def test_import_logits_equal_transformers(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved)
    # each gpt-oss option changes the result (so the equality above covers it)
    for change in (dict(attn_sinks=False), dict(swiglu_limit=None), dict(layer_types=None, sliding_window=None)):
        other = dataclasses.replace(cfg, **change)
        kept = params if other.attn_sinks else tree.tree_map(lambda x: x, params)
        if not other.attn_sinks:
            for layer in kept["layers"]:
                layer["self_attn"] = {k: v for k, v in layer["self_attn"].items() if k != "sinks"}
        assert not torch.allclose(our_logits(kept, other, toks), want, atol=1e-3), change


def _hf_grad(ours: dict, name: str) -> torch.Tensor:
    """Our gradient of transformers' in-memory parameter ``name``, in its layout."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    m = f"layers.{layer}.mlp"
    if name.endswith("experts.gate_up_proj"):
        return torch.stack([ours[f"{m}.gate"], ours[f"{m}.up"]], -1).flatten(-2)
    if name.endswith("experts.gate_up_proj_bias"):
        return torch.stack([ours[f"{m}.expert_gate_bias"], ours[f"{m}.expert_up_bias"]], -1).flatten(-2)
    direct = {"experts.down_proj": f"{m}.down", "experts.down_proj_bias": f"{m}.expert_down_bias",
              "router.bias": f"{m}.router_logit_bias", "router.weight": f"{m}.router"}
    for suffix, path in direct.items():
        if name.endswith("mlp." + suffix):
            return ours[path].T if suffix == "router.weight" else ours[path]
    path = hf.our_path(name)
    kind = hf.KINDS[hf.hf_kind(path, "gpt_oss")]
    return kind.to_hf(ours[path])


def test_loss_and_gradients_equal_transformers(saved):
    _, d = saved
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    names = [n for n, _ in model.named_parameters()]
    assert any("sinks" in n for n in names) and any("router.bias" in n for n in names)
    for name, p in model.named_parameters():
        torch.testing.assert_close(_hf_grad(ours, name), p.grad, rtol=1e-4, atol=1e-6 * p.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "gpt_oss", "GptOssForCausalLM", **EAGER)


def test_expert_and_tensor_parallel_equal_one_device(saved):
    """EP x TP on simulated devices: the experts (and their biases) over dp_shard, heads (and the
    sinks), kv_heads, the experts' mlp and the vocabulary over tp."""
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss, grads = single_device(cfg, params, batch)
    rules = Rules(batch="dp_shard", experts="dp_shard", heads="tp", kv_heads="tp", vocab="tp", mlp="tp")
    p_loss, p_grads, _ = parallel(cfg, params, batch, fpp.Mesh(dp_shard=2, tp=2), rules)[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def test_context_parallel_sinks_equal_one_device(saved):
    """CP: the sinks' softmax over every key takes the K/V all-gather path (the ring has none)."""
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    cfg = dataclasses.replace(cfg, layer_types=None, sliding_window=None)     # full layers: no window either
    batch = make_batch(cfg, batch=2, seq=12, seed=4)
    loss, grads = single_device(cfg, params, batch)
    rules = llama.default_rules(tp=False)
    p_loss, p_grads, _ = parallel(cfg, params, batch, fpp.Mesh(dp_shard=1, cp=2), rules)[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def test_fsdp_tp_on_real_processes_equal_one_device(saved):
    """Two AdamW steps with FSDP x TP on four real gloo processes (the sinks split over tp, the
    experts' hidden over dp_shard) equal one device (the biases trained by the first step act
    in the second)."""
    from harness import assert_processes_equal_one_device
    assert_processes_equal_one_device(hf.config_from_hf(saved[1]))


def test_refusals_name_the_option(saved, tmp_path):
    conf = json.loads((saved[1] / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF gpt_oss config: attention_bias=False is not supported"):
        hf.config_from_hf(dict(conf, attention_bias=False))
    with pytest.raises(ck.CheckpointMismatchError, match=r"rope type 'dynamic' is not supported"):
        hf.config_from_hf(dict(conf, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    cfg = hf.config_from_hf(saved[1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'gpt_oss': attn_sinks=False has no "
                                                         r"GptOssForCausalLM equivalent"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, attn_sinks=False), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'mixtral': attn_sinks=True has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="mixtral"), tmp_path / "no")
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match=r"moe_bias / swiglu_limit are options of the experts"):
        llama.Config.tiny(moe_bias=True)
