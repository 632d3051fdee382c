"""The experts' stacked weights quantized (Axolotl's ``quantize_moe_experts``, issue 47): each
stack (``gate`` / ``up`` ``experts hidden mlp``, ``down`` ``experts mlp hidden``) quantized as
bitsandbytes' ``quantize_4bit`` quantizes the stacked Hugging Face tensor ``[experts, out, in]``
(Axolotl's ``replace_parameter_4bit``): codes, scales and double quantization bit-equal; the
model's loss with such experts equals the loss with the dequantized experts on one device, and
EP x FSDP and EP x TP equal one device, with and without LoRA on the experts (whose adapters'
gradients too); a stack whose experts hold no whole blocks of 64 (gathered whole) as well; the
config key is accepted with load_in_4bit / load_in_8bit and an adapter, refused without."""
from __future__ import annotations

import pytest
import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama
from functional_pp.models.quantize import EXPERT_BLOCK_DIMS, quantize_linear_weights, quantized_decls
from functional_pp.parallel import sharding
from functional_pp.quant.blockwise import pack_4bit, unpack_4bit
from functional_pp.quant.codebooks import dynamic_map
from functional_pp.quant.weights import QuantizedWeight, dequantize, hf_order, quantize_int8, quantize_nf4

bnb = pytest.importorskip("bitsandbytes.functional")
_REFERENCE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)

CFG = llama.Config.tiny(model_type="qwen3_moe", experts=4, experts_top_k=2, moe_mlp=32, norm_topk_prob=True)
LAYOUTS = {
    "ep_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2), Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard")),
    "ep_x_tp": (fpp.Mesh(dp_shard=2, tp=2), Rules(batch="dp_shard", experts="dp_shard", heads="tp", kv_heads="tp",
                                                  vocab="tp", mlp="tp")),
}
LORA = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "gate", "up", "down"))


def _stack(e: int, n_in: int, n_out: int, seed: int) -> torch.Tensor:
    """A functional stack ``[experts, in, out]`` (as ``gate`` is ``experts hidden mlp``)."""
    return torch.randn(e, n_in, n_out, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.mark.parametrize("shape", [(4, 64, 32), (3, 48, 10), (2, 40, 6)], ids=["blocks", "rows_cross", "padded"])
def test_stack_codes_and_scales_equal_bitsandbytes_of_the_stacked_hugging_face_tensor(shape):
    w = _stack(*shape, seed=sum(shape))
    hf = hf_order(w, 1, lead=1).contiguous()                      # [experts, out, in], as transformers 5 holds it
    packed, state = bnb.quantize_4bit(hf, blocksize=64, quant_type="nf4", compress_statistics=False)
    q = quantize_nf4(w, 1, double_quant=False, lead=1)
    assert q.flat and q.codes.shape == (shape[0], shape[1], shape[2] // 2)
    assert torch.equal(pack_4bit(hf_order(unpack_4bit(q.codes), 1, lead=1).reshape(-1)), packed.reshape(-1))
    assert torch.equal(q.absmax, state.absmax)
    ref = torch.ops.bitsandbytes.dequantize_4bit.default.redispatch(_REFERENCE, packed, state.absmax, 64, "nf4",
                                                                    hf.shape, torch.float32)
    assert torch.equal(hf_order(dequantize(q, block_dim=1, lead=1), 1, lead=1), ref)
    d = quantize_nf4(w, 1, double_quant=True, lead=1)              # compress_statistics over the whole stack
    offset = state.absmax.mean()
    codes, absmax2 = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
        _REFERENCE, state.absmax - offset, dynamic_map(True), 256)
    assert torch.equal(d.absmax, codes) and torch.equal(d.absmax2, absmax2) and torch.equal(d.offset, offset)


def test_int8_stack_is_blockwise_absmax_of_the_flattened_stack():
    w = _stack(3, 64, 10, seed=5)
    q = quantize_int8(w, 1, lead=1)
    hf = hf_order(w, 1, lead=1).reshape(-1, 64)                   # 1920 entries: whole blocks of the stack
    assert q.flat and torch.equal(q.absmax, hf.abs().amax(-1))
    assert ((dequantize(q, block_dim=1, lead=1) - w).abs() <= q.absmax.max() / 254 + 1e-7).all()


def test_only_the_expert_stacks_and_the_linear_weights_are_quantized():
    decls = llama.init(CFG)
    mlp = quantized_decls(decls, "nf4", experts=True)["layers"][0]["mlp"]
    assert all(isinstance(mlp[k], QuantizedWeight) for k in EXPERT_BLOCK_DIMS)
    assert mlp["gate"].absmax.dims == ("qblocks_of_hidden@experts",) and mlp["down"].codes.dims == decls[
        "layers"][0]["mlp"]["down"].dims
    assert not isinstance(mlp["router"], QuantizedWeight)
    assert not isinstance(quantized_decls(decls, "nf4")["layers"][0]["mlp"]["gate"], QuantizedWeight)


def _model(cfg, kind="nf4", lora=None):
    """``(decls, full params, quantized params, quantized decls, dequantized params)``: only the
    experts quantized (the attention's weights are the dense tests')."""
    decls = llama.init(cfg, torch.float64)
    if lora is not None:
        decls = adapters.init(decls, lora)
    g = torch.Generator().manual_seed(3)
    full = {p: (0.2 * torch.randn(x.data.shape, generator=g, dtype=x.data.dtype) if p.endswith("lora_B") else x.data)
            for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=0))}
    full = map_with_path(lambda p, d: full[p], decls)
    qp, qd = quantize_linear_weights(full, decls, kind, experts=True, block_dims={})
    lead = {"gate": 1, "up": 1, "down": 1}
    deq = map_with_path(lambda p, x: x, qp)
    for layer in deq["layers"]:
        for k in lead:
            layer["mlp"][k] = dequantize(layer["mlp"][k], torch.float64, block_dim=1, lead=1)
    return decls, qp, qd, deq


def _loss(cfg, params, decls, batch, mesh=None, rules=None, lora=None, processes=False):
    """Per device the loss and the gathered gradients of the adapters (LoRA) ."""
    mesh, rules = mesh or fpp.Mesh(), rules or Rules()
    loss_fn = adapters.adapt(llama.loss, lora) if lora is not None else llama.loss

    def device():
        with fpp.use_rules(rules):
            local = sharding.shard(params, decls, mesh, rules, fpp.current_rank())
            local = tree.tree_map(lambda t: t.clone().requires_grad_() if t.is_floating_point() else t, local)
            loss = loss_fn(sharding.named_tree(local, decls), {k: fpp.named(v, "batch seq") for k, v in batch.items()},
                           cfg).value()
            if lora is None:
                return loss.detach(), {}
            loss.backward()
            grads = {p: t.grad for p, t in fpp.leaves_with_paths(local) if ".lora." in p}
            mine = {p: d for p, d in fpp.leaves_with_paths(decls) if p in grads}
            return loss.detach(), fpp.gather_tree(grads, mine, rules)
    return fpp.launch(device, mesh, **({"processes": True, "timeout": 300} if processes else {}))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_experts_loss_equals_the_dequantized_experts_loss(kind):
    decls, qp, qd, deq = _model(CFG, kind)
    batch = make_batch(CFG, batch=4, seq=8, seed=1)
    ((got, _),) = _loss(CFG, qp, qd, batch)
    ((want, _),) = _loss(CFG, deq, decls, batch)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert not torch.equal(qp["layers"][0]["mlp"]["gate"].codes, torch.zeros_like(qp["layers"][0]["mlp"]["gate"].codes))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ep_layouts_equal_one_device(layout):
    decls, qp, qd, _ = _model(CFG)
    batch = make_batch(CFG, batch=4, seq=8, seed=1)
    ((want, _),) = _loss(CFG, qp, qd, batch)
    for loss, _ in _loss(CFG, qp, qd, batch, *LAYOUTS[layout]):
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)


def test_experts_without_whole_blocks_are_gathered_whole_and_still_equal():
    cfg = llama.Config.tiny(model_type="qwen3_moe", hidden=48, experts=4, experts_top_k=2, moe_mlp=10)
    decls, qp, qd, deq = _model(cfg)              # 480 entries an expert: blocks cross experts
    batch = make_batch(cfg, batch=4, seq=8, seed=1)
    ((want, _),) = _loss(cfg, deq, decls, batch)
    mesh, rules = fpp.Mesh(dp_shard=2, ep=2), Rules(batch=("dp_shard", "ep"), experts="ep")
    for loss, _ in [*_loss(cfg, qp, qd, batch), *_loss(cfg, qp, qd, batch, mesh, rules)]:
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_on_quantized_experts_equals_the_dequantized_base_and_one_device(layout):
    decls, qp, qd, deq = _model(CFG, lora=LORA)
    batch = make_batch(CFG, batch=4, seq=8, seed=1)
    ((want, want_g),) = _loss(CFG, deq, decls, batch, lora=LORA)
    assert want_g and any(".mlp.lora.gate." in p for p in want_g)
    ((one, one_g),) = _loss(CFG, qp, qd, batch, lora=LORA)
    torch.testing.assert_close(one, want, rtol=1e-12, atol=0)
    for loss, grads in _loss(CFG, qp, qd, batch, *LAYOUTS[layout], lora=LORA):
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
        for p, g in want_g.items():
            torch.testing.assert_close(grads[p], g, rtol=1e-9, atol=1e-12)


@pytest.mark.multiprocess
def test_ep_with_lora_on_two_gloo_processes_equals_simulation():
    decls, qp, qd, _ = _model(CFG, lora=LORA)
    batch = make_batch(CFG, batch=4, seq=8, seed=1)
    mesh, rules = fpp.Mesh(dp_shard=2), Rules(batch="dp_shard", experts="dp_shard", hidden="dp_shard")
    for (a, ga), (b, gb) in zip(_loss(CFG, qp, qd, batch, mesh, rules, lora=LORA, processes=True),
                                _loss(CFG, qp, qd, batch, mesh, rules, lora=LORA)):
        assert torch.equal(a, b) and ga.keys() == gb.keys()
        for p in ga:
            torch.testing.assert_close(ga[p], gb[p], rtol=0, atol=0)


def _tiny_moe(path):
    """A tiny Hugging Face Qwen3-MoE (hidden 128: the dense weights' blocks split over 2 devices)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conf = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False)
    transformers.Qwen3MoeForCausalLM(conf).save_pretrained(path)
    return path


def test_config_trains_qlora_over_quantized_experts_with_ep(tmp_path):
    from functional_pp import checkpoint as ck
    from functional_pp import cli
    from functional_pp.app.metrics import read_metrics
    from functional_pp.checkpoint import hf
    from functional_pp.config import ConfigError, TrainConfig
    pytest.importorskip("transformers")
    base = _tiny_moe(tmp_path / "tiny-qwen3-moe")
    config = tmp_path / "qlora_moe.yaml"
    config.write_text(f"base_model: {base}\nadapter: qlora\nload_in_4bit: true\nquantize_moe_experts: true\n"
                      "lora_target_modules: [q_proj]\nlora_target_parameters: [mlp.experts.down_proj]\n"
                      "lora_r: 4\nlora_alpha: 8\nexpert_parallel_size: 2\nsequence_len: 32\n"
                      "micro_batch_size: 2\nglobal_batch_size: 8\nmax_steps: 2\nsave_steps: 2\n"
                      "learning_rate: 1.0e-3\nlr_scheduler: constant\nwarmup_steps: 0\n"
                      "data: {path: null, max_bytes: 20000}\nlogging: {log_every: 1, plot: false}\n")
    out = tmp_path / "run"
    assert cli.main(["train", str(config), "--simulate", "2", "--output", str(out)]) == 0
    losses = [m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    cfg = hf.config_from_hf(base)
    lora = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "down"))
    decls = quantized_decls(adapters.init(llama.init(cfg), lora), "nf4", experts=True)
    params = ck.load_checkpoint(out / "checkpoints", {"params": decls}, keys=["params"]).tree["params"]
    down = params["layers"][0]["mlp"]["down"]
    assert isinstance(down, QuantizedWeight) and down.codes.dtype == torch.uint8
    assert params["layers"][0]["mlp"]["lora"]["down"]["lora_B"].abs().max() > 0
    with pytest.raises(ConfigError, match="quantize_moe_experts.*load_in_4bit"):
        TrainConfig.from_dict({"adapter": "lora", "quantize_moe_experts": True})
