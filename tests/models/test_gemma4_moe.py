"""Gemma 4 26B-A4B's experts beside the dense MLP (``enable_moe_block``) as options of the one
decoder and of the shared experts op (models/moe.py's ``beside_mlp``, ``ops.experts``'
``router_x``, ``expert_scale`` and ``activation``): the router scores a weightless RMSNorm of the
residual stream times ``router.scale`` and ``hidden ** -0.5``, its renormalised top-k weights times
``router.per_expert_scale`` weigh tanh-GELU experts of ``pre_feedforward_layernorm_2`` of the
residual stream, and the MLP's and the experts' outputs, each normed, are summed before
``post_feedforward_layernorm``. A tiny random ``Gemma4ForCausalLM`` transformers builds loads
through the HF import (``router.proj``, ``experts.gate_up_proj``, ``experts.down_proj``); logits,
loss and every gradient equal transformers'; export round-trips; LoRA on the attention, the dense
MLP and the experts (peft's ``target_parameters``) equals peft's; EP x TP, EP x FSDP and FSDP x TP
with sequence parallelism equal one device on simulated devices, EP x TP on real gloo processes."""
import dataclasses
import json

import pytest
import torch
from harness import (assert_export_round_trip, fp64_beside_hf, import_logits_beside_hf, make_batch, our_logits,
                     parallel, single_device)

import functional_pp as fpp
from functional_pp import adapters
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.models import llama
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4ForCausalLM"):
    pytest.skip("transformers without Gemma 4", allow_module_level=True)

E, F = 4, 16
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
              attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
              layer_types=["sliding_attention", "full_attention"], enable_moe_block=True, num_experts=E,
              top_k_experts=2, moe_intermediate_size=F, pad_token_id=None, bos_token_id=None, eos_token_id=None,
              max_position_embeddings=128)
EAGER = dict(attn_implementation="eager", experts_implementation="eager")
EP_TP = (fpp.Mesh(dp_shard=2, tp=2), Rules(batch="dp_shard", experts="dp_shard", heads="tp", kv_heads="tp",
                                           vocab="tp", mlp="tp"))
LAYOUTS = {"ep_x_tp": EP_TP,
           "ep_axis_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2), Rules(batch=("dp_shard", "ep"), experts="ep",
                                                                hidden="dp_shard")),
           "fsdp_tp_sp": (fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True))}


def _randomize(model) -> None:
    """O(1) logits; q/k norms below 1; norms, router scales and layer scalars off 1 (so each acts)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.4 + 0.05 * torch.randn_like(p) if ("q_norm" in name or "k_norm" in name) else
                    1 + 0.2 * torch.randn_like(p) if ("norm" in name or name.endswith("scale")) else
                    0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.2 * torch.rand_like(b))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**CONFIG)).float().eval()
    _randomize(model)
    d = tmp_path_factory.mktemp("gemma4_moe")
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    return model, d


def test_config_and_declarations(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.experts, cfg.experts_top_k, cfg.moe_mlp, cfg.norm_topk_prob, cfg.experts_beside_mlp, cfg.mlp) == (
        E, 2, F, True, True, 48)
    decls = dict(tree.leaves_with_paths(llama.init(cfg)))
    assert decls["layers.0.mlp.gate_proj"].shape == (64, 48) and decls["layers.0.mlp.gate"].shape == (E, 64, F)
    assert decls["layers.0.mlp.router_scale"].dims == ("hidden",) and decls["layers.0.mlp.expert_scale"].dims == (
        "experts",)
    assert "layers.1.pre_feedforward_layernorm_2" in decls and "layers.1.post_feedforward_layernorm_1" in decls


def test_import_logits_equal_transformers(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved)
    # the router's scales and the experts' activation each change the result
    for key in ("router_scale", "expert_scale"):
        ones = tree.tree_map(lambda t: t, params)
        for layer in ones["layers"]:
            layer["mlp"][key] = torch.ones_like(layer["mlp"][key])
        assert not torch.allclose(our_logits(ones, cfg, toks), want, atol=1e-3), key
    zero = tree.tree_map(lambda t: t, params)            # (the experts matter: without them, other logits)
    for layer in zero["layers"]:
        layer["post_feedforward_layernorm_2"] = torch.zeros_like(layer["post_feedforward_layernorm_2"])
    assert not torch.allclose(our_logits(zero, cfg, toks), want, atol=1e-3)


def _hf_grad(ours: dict, name: str) -> torch.Tensor:
    """Our gradient of transformers' in-memory parameter ``name``, in its layout."""
    m = f"layers.{name.split('.')[2]}.mlp" if name.startswith("model.layers.") else None
    if name.endswith("experts.gate_up_proj"):
        return torch.cat([ours[f"{m}.gate"], ours[f"{m}.up"]], -1).transpose(1, 2)
    if name.endswith("experts.down_proj"):
        return ours[f"{m}.down"].transpose(1, 2)
    if name.endswith("router.proj.weight"):
        return ours[f"{m}.router"].T
    path = hf.our_path(name)
    return hf.KINDS[hf.hf_kind(path, "gemma4_text")].to_hf(ours[path])


def test_loss_and_gradients_equal_transformers(saved):
    model, cfg, loss, grads, out, want = fp64_beside_hf(saved[1], **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    names = [n for n, _ in model.named_parameters()]
    assert "model.layers.0.router.per_expert_scale" in names and "model.layers.0.experts.gate_up_proj" in names
    for name, p in model.named_parameters():
        torch.testing.assert_close(_hf_grad(ours, name), p.grad, rtol=1e-4, atol=1e-6 * p.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "gemma4_text", "Gemma4ForCausalLM", **EAGER)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["enable_moe_block"], written["num_experts"], written["top_k_experts"],
            written["moe_intermediate_size"]) == (True, E, 2, F)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_equal_one_device(saved, layout):
    """EP x TP (the experts over dp_shard, heads, the dense and the experts' mlp and the vocabulary
    over tp), EP on its own axis x FSDP (the router's scale, the norms and every weight's hidden over
    dp_shard) and FSDP x TP with sequence parallelism (the router scoring the gathered residual)."""
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss, grads = single_device(cfg, params, batch)
    for p_loss, p_grads, _ in parallel(cfg, params, batch, *LAYOUTS[layout]):
        torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
        for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def test_ep_tp_on_real_processes_equals_one_device(saved):
    """Two AdamW steps with EP x TP on four real gloo processes equal one device."""
    from harness import assert_processes_equal_one_device
    one = assert_processes_equal_one_device(hf.config_from_hf(saved[1]), *EP_TP)
    assert float(abs(one[1]["layers.0.mlp.expert_scale"] - 1).max()) > 0      # (trained)


def test_lora_equals_peft_with_target_parameters(saved):
    """peft's LoRA on q_proj, the dense MLP's gate_proj and the experts' fused tensors
    (``target_parameters``: ``experts.gate_up_proj``, gate and up sharing an A, and
    ``experts.down_proj``), as Axolotl's 26B-A4B QLoRA config targets them: loss and every
    adapter gradient equal ours, fp32."""
    peft = pytest.importorskip("peft")
    import torch.nn.functional as Fn
    model = transformers.AutoModelForCausalLM.from_pretrained(saved[1], dtype=torch.float32, **EAGER)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"],
                                                    target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    cfg = hf.config_from_hf(saved[1])
    batch = make_batch(cfg, batch=2, seq=8, seed=1)
    logits = pm(input_ids=batch["tokens"]).logits
    want = Fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    want.backward()
    pa = {n: p for n, p in pm.named_parameters() if "lora_" in n}

    def peft_t(i, where, ab, grad=False):
        t = pa[f"base_model.model.model.layers.{i}.{where}.lora_{ab}.default.weight"]
        return t.grad if grad else t.detach()

    def expert(t, ab):               # peft's A (E*r, in) / B (out, E*r) -> ours A (E, in, r) / B (E, r, out)
        return t.reshape(E, 4, -1).transpose(1, 2) if ab == "A" else t.reshape(-1, 4, E).permute(2, 1, 0)

    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "gate_proj", "gate", "up", "down"),
                             shared_a=(("gate", "up"),))
    decls = adapters.init(llama.init(cfg), lc)
    places = {"gu": "experts.base_layer", "d": "experts"}     # (peft nests the two wrappers)
    lora = {}
    for i in range(2):
        q_a, q_b = peft_t(i, "self_attn.q_proj", "A"), peft_t(i, "self_attn.q_proj", "B")
        lora[f"layers.{i}.self_attn.q_proj"] = {"lora_A": q_a.T.contiguous(),
                                                "lora_B": q_b.T.reshape(4, 4, -1).contiguous()}
        lora[f"layers.{i}.mlp.gate_proj"] = {ab: peft_t(i, "mlp.gate_proj", ab[-1]).T.contiguous()
                                             for ab in ("lora_A", "lora_B")}
        b_gu = expert(peft_t(i, places["gu"], "B"), "B")
        lora[f"layers.{i}.mlp.gate"] = {"lora_A": expert(peft_t(i, places["gu"], "A"), "A").contiguous(),
                                        "lora_B": b_gu[..., :F].contiguous()}
        lora[f"layers.{i}.mlp.up"] = {"lora_B": b_gu[..., F:].contiguous()}
        lora[f"layers.{i}.mlp.down"] = {ab: expert(peft_t(i, places["d"], ab[-1]), ab[-1]).contiguous()
                                        for ab in ("lora_A", "lora_B")}
    full = adapters.joined(hf.load_hf_params(saved[1], cfg), lora)
    local = tree.tree_map(lambda t: t.clone().requires_grad_(), full)
    loss = adapters.adapt(llama.loss, lc)(sharding.named_tree(local, decls),
                                          {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}, cfg).value()
    loss.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    grads = {p: t.grad for p, t in fpp.leaves_with_paths(local) if ".lora." in p}
    close = dict(rtol=1e-4, atol=1e-6)
    for i in range(2):
        def got(path, ab):
            return grads[f"layers.{i}.{path.rsplit('.', 1)[0]}.lora.{path.rsplit('.', 1)[1]}.lora_{ab}"]
        torch.testing.assert_close(got("self_attn.q_proj", "A"), peft_t(i, "self_attn.q_proj", "A", True).T, **close)
        torch.testing.assert_close(got("mlp.gate_proj", "B"), peft_t(i, "mlp.gate_proj", "B", True).T, **close)
        torch.testing.assert_close(got("mlp.gate", "A"), expert(peft_t(i, places["gu"], "A", True), "A"), **close)
        torch.testing.assert_close(torch.cat([got("mlp.gate", "B"), got("mlp.up", "B")], -1),
                                   expert(peft_t(i, places["gu"], "B", True), "B"), **close)
        for ab in "AB":
            torch.testing.assert_close(got("mlp.down", ab), expert(peft_t(i, places["d"], ab, True), ab), **close)


def test_refusals_name_the_option(saved, tmp_path):
    conf = json.loads((saved[1] / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=r"enable_moe_block=True needs num_experts"):
        hf.config_from_hf(dict(conf, num_experts=None))
    cfg = hf.config_from_hf(saved[1])
    params = fpp.init_params(llama.init(cfg), seed=0)
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'gemma4_text': router_aux_loss_coef=0.1 has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, router_aux_loss_coef=0.1), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'qwen3_moe': .* has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="qwen3_moe"), tmp_path / "no")
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match=r"experts_beside_mlp=True .* needs experts > 0 in every layer"):
        dataclasses.replace(cfg, moe_layers=(0,))


def test_experts_op_refuses_a_router_input_of_other_tokens_and_an_unknown_activation():
    from functional_pp.ops.experts import experts
    x = fpp.wrap(torch.randn(2, 3, 8), "batch seq hidden")
    weights = dict(router=fpp.wrap(torch.randn(8, 4), "hidden experts"),
                   gate=fpp.wrap(torch.randn(4, 8, 6), "experts hidden mlp"),
                   up=fpp.wrap(torch.randn(4, 8, 6), "experts hidden mlp"),
                   down=fpp.wrap(torch.randn(4, 6, 8), "experts mlp hidden"))
    with pytest.raises(ValueError, match=r"router_x has dims \('seq', 'batch', 'hidden'\).*needs x's"):
        experts(x, **weights, top_k=2, router_x=fpp.wrap(torch.randn(3, 2, 8), "seq batch hidden"))
    with pytest.raises(ValueError, match=r"activation 'relu' is not one of silu, gelu_tanh"):
        experts(x, **weights, top_k=2, activation="relu")
    with pytest.raises(ValueError, match=r"expert_scale has dims \('hidden',\); it needs exactly \['experts'\]"):
        experts(x, **weights, top_k=2, expert_scale=fpp.wrap(torch.ones(8), "hidden"))
