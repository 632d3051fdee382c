"""Gemma 4 E2B / E4B's text decoder (``gemma4_text`` with ``hidden_size_per_layer_input`` > 0) as a
configuration of the one decoder (models/llama.py, models/per_layer_inputs.py): per-layer input
embeddings (their own table, a projection of the embedding, a gate in every layer). A tiny random
``Gemma4ForCausalLM`` transformers builds loads through the HF import; logits, loss and every
gradient equal transformers'; export writes a directory transformers loads to the same logits;
LoRA on the per-layer gate equals peft; FSDP x TP with sequence parallelism and CP on simulated
devices, and FSDP x TP on real gloo processes, equal one device."""
import dataclasses
import json

import pytest
import torch
from harness import (assert_hf_layout_equals_one_device, assert_lora_step_equals_peft, fp64_beside_hf,
                     import_logits_beside_hf, our_logits, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4ForCausalLM"):
    pytest.skip("transformers without Gemma 4", allow_module_level=True)

# E2B's shape in small: per-layer inputs of 16 per layer, sliding layers with a window shorter than the
# sequence; the last two layers (one sliding, one full) reuse the keys and values of layers 3 and 2, with a
# double-wide MLP
TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
CONFIG = dict(vocab_size=256, vocab_size_per_layer_input=256, hidden_size=64, intermediate_size=48,
              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
              sliding_window=4, hidden_size_per_layer_input=16, final_logit_softcapping=30.0, layer_types=TYPES,
              num_kv_shared_layers=2, use_double_wide_mlp=True,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=128)
EAGER = dict(attn_implementation="eager")


def _randomize(model) -> None:
    """O(1) logits; q/k norms below 1 (no 1/sqrt(d) softmax scale); layer scalars off 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.4 + 0.05 * torch.randn_like(p) if ("q_norm" in name or "k_norm" in name) else
                    1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.2 * torch.rand_like(b))


def _build(d, **over):
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**dict(CONFIG, **over))).float().eval()
    _randomize(model)
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = "eager"
    return model, d


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("gemma4_e2b"))


def test_config_and_parameters(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.per_layer_input, cfg.layers, cfg.kv_shared_layers, cfg.double_wide_mlp) == (
        "gemma4_text", 16, 6, 2, True)
    assert [cfg.kv_source(i) for i in range(6)] == [None, None, 2, 3, 3, 2]     # (transformers' store / reuse)
    decls = dict(tree.leaves_with_paths(llama.init(cfg)))
    assert decls["embed_tokens_per_layer"].shape == (256, 6 * 16)
    assert "layers.4.self_attn.k_proj" not in decls and "layers.5.self_attn.k_norm" not in decls
    assert decls["layers.3.self_attn.k_proj"].shape == (64, 2, 16) and decls["layers.5.self_attn.q_norm"].shape == (32,)
    assert decls["layers.3.mlp.up_proj"].shape == (64, 48) and decls["layers.4.mlp.up_proj"].shape == (64, 96)
    assert decls["per_layer_model_projection"].dims == ("hidden", "per_layer_all")
    assert decls["layers.2.per_layer_input_gate"].shape == (64, 16)
    assert decls["layers.2.per_layer_projection"].shape == (16, 64)


def test_files_with_the_shared_layers_own_kv_load(saved, tmp_path):
    """The published files keep k/v projections and norms in the shared layers, which transformers does not
    read: they load, unread, to the same parameters."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(saved[1] / "model.safetensors")
    extra = {f"model.layers.{i}.self_attn.{n}.weight": torch.randn(s) for i in (4, 5)
             for n, s in (("k_proj", (32, 64)), ("v_proj", (32, 64)), ("k_norm", (16,)))}
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((saved[1] / "config.json").read_text())
    cfg, params = hf.load_hf_llama(tmp_path)
    want = hf.load_hf_llama(saved[1])[1]
    for (path, a), (_, b) in zip(tree.leaves_with_paths(params), tree.leaves_with_paths(want)):
        assert torch.equal(a, b), path
    save_file({**tensors, "model.layers.3.self_attn.q_norm.extra": torch.ones(2)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ck.CheckpointMismatchError, match=r"unexpected tensors"):
        hf.load_hf_llama(tmp_path)


def test_import_logits_equal_transformers(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved)
    zero = tree.tree_map(lambda t: t, params)             # (a new tree: the per-layer gates off)
    for layer in zero["layers"]:
        layer["per_layer_input_gate"] = torch.zeros_like(layer["per_layer_input_gate"])
    assert not torch.allclose(our_logits(zero, cfg, toks), want, atol=1e-3)


def test_loss_and_gradients_equal_transformers(saved):
    model, cfg, loss, grads, out, want = fp64_beside_hf(saved[1], **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    seen = set()
    for name, p in model.named_parameters():
        path = hf.our_path(name)
        seen.add(path)
        got = hf.KINDS[hf.hf_kind(path, "gemma4_text")].to_hf(ours[path])
        # (transformers' rotary tables are float32 in a float64 model: ~1e-7 of each gradient's scale)
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")
    assert {"embed_tokens_per_layer", "per_layer_model_projection", "layers.0.per_layer_projection"} <= seen


def test_export_round_trip_in_transformers(saved, tmp_path):
    """Export of changed weights writes a ``Gemma4ForCausalLM`` directory (the per-layer tables, no k/v
    projections in the shared layers) that transformers loads to our logits (in float64: transformers'
    rotary tables are float32, ~1e-6 here after six layers)."""
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    params = tree.tree_map(lambda t: t + 0.01 * torch.randn_like(t), params)     # not the file's values
    out = hf.save_hf_llama(params, cfg, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert (written["architectures"], written["num_kv_shared_layers"], written["hidden_size_per_layer_input"],
            written["use_double_wide_mlp"]) == (["Gemma4ForCausalLM"], 2, 16, True)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, **EAGER)
    toks = tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=toks).logits, our_logits(params, cfg, toks), atol=1e-5, rtol=1e-5)


def test_lora_equals_peft(saved):
    """LoRA on q_proj and the per-layer gate and projection: the loss and every adapter gradient equal peft's."""
    model = transformers.AutoModelForCausalLM.from_pretrained(saved[1], dtype=torch.float32, **EAGER)
    assert_lora_step_equals_peft(model, saved[1], ("q_proj", "per_layer_input_gate", "per_layer_projection"))


@pytest.mark.parametrize("layout", ["fsdp_tp_sp", "cp"])
def test_layouts_equal_one_device(saved, layout):
    """FSDP x TP with sequence parallelism (the per-layer tables' vocabulary over tp, hidden over
    dp_shard, the per-layer branch on the gathered sequence) and CP (the per-layer inputs split
    with the sequence)."""
    assert_hf_layout_equals_one_device(saved[1], layout)


def test_fsdp_tp_on_real_processes_equal_one_device(saved):
    """Two SGD steps with FSDP x TP on four real gloo processes equal one device (SGD: AdamW's
    normalisation turns the summation-order noise of a near-zero gradient entry into a whole step,
    ~1e-7 of a tied embedding's entry after two steps)."""
    from harness import assert_processes_equal_one_device
    one = assert_processes_equal_one_device(hf.config_from_hf(saved[1]), opt=fpp.optim.sgd(0.5))
    assert float(one[1]["per_layer_projection_norm"][0]) != 1.0 and float(one[1]["layers.5.input_layernorm"][0]) != 1.0


def test_refusals_name_the_option(saved, tmp_path):
    conf = json.loads((saved[1] / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"vocab_size_per_layer_input=128 is not supported"):
        hf.config_from_hf(dict(conf, vocab_size_per_layer_input=128))
    cfg = hf.config_from_hf(saved[1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'gemma3_text': .*per_layer_input=16 has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="gemma3_text", global_head_dim=None,
                                                      global_kv_heads=None, v_norm=False, layer_scalar=False),
                         tmp_path / "no")
    with pytest.raises(ValueError, match=r"per_layer_input must be a non-negative integer"):
        dataclasses.replace(cfg, per_layer_input=-1)
    with pytest.raises(ValueError, match=r"kv_shared_layers must be an integer in \[0, layers=6\).*got 6"):
        dataclasses.replace(cfg, kv_shared_layers=6)
    with pytest.raises(ValueError, match=r"shared layers' type\(s\) \['full_attention'\] have no earlier layer"):
        dataclasses.replace(cfg, layer_types=("sliding_attention",) * 5 + ("full_attention",))


def test_pipelines_and_cached_sampling_are_refused_by_name(saved):
    """A pipeline stage and a key / value cache name the options they cannot run yet, before any work."""
    import functools

    from functional_pp.models.sampling import generate
    from functional_pp.parallel.pipeline.stage import StageRun, running_stage
    from functional_pp.parallel import sharding
    cfg, params = hf.load_hf_llama(saved[1])
    params = sharding.named_tree(params, llama.init(cfg))
    with running_stage(StageRun(0, 2, None, cut=True)), \
            pytest.raises(ValueError, match=r"pipeline parallelism \(pp\) with per_layer_input=16, kv_shared_layers=2"):
        llama.forward(params, fpp.wrap(tokens(), "batch seq"), cfg)
    with pytest.raises(ValueError, match=r"key / value cache does not support kv_shared_layers=2"):
        generate(functools.partial(llama.forward, cfg=cfg), params, tokens()[:1, :4], max_new_tokens=2)


def test_plan_extrapolates_the_layers_as_the_whole_run(saved):
    """``functional-pp plan``'s dry-run of FSDP x TP: extrapolated from the first layers (plain, k/v-making and
    sharing ones differ) it counts the parameters and FLOPs of running every layer."""
    import functools

    from functional_pp import plan
    cfg = hf.config_from_hf(saved[1])
    loss, batch = functools.partial(llama.loss, cfg=cfg), {"tokens": ((4, 16), "batch seq"),
                                                           "labels": ((4, 16), "batch seq")}
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()
    fast = plan.estimate(loss, llama.init(cfg), mesh, rules, batch)
    whole = plan.estimate(loss, llama.init(cfg), mesh, rules, batch, repeated=None)
    assert (fast.param_bytes, fast.state_bytes, fast.flops) == (whole.param_bytes, whole.state_bytes, whole.flops)
    assert fast.flops > 0 and whole.param_bytes > 0


@pytest.mark.parametrize("remat", [True, "selective"])
def test_recomputed_layers_equal_kept_ones(saved, remat):
    """Activation checkpointing recomputes each layer from its inputs, the per-layer input and the shared keys
    and values among them: two AdamW steps bitwise equal to keeping the activations."""
    from harness import assert_same_run, launch_steps
    cfg = hf.config_from_hf(saved[1])
    assert_same_run(launch_steps(cfg, dtype=torch.float64)[0], launch_steps(cfg, dtype=torch.float64, remat=remat)[0])
