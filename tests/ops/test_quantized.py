"""Quantized frozen weights (quant/weights.py, ops/quantized.py, models/quantize.py): NF4 and
int8 against bitsandbytes, a forward with NF4 linear weights against the dequantized weights'
forward on one device, FSDP and TP, and the bytes FSDP all-gathers."""
from __future__ import annotations

import optree
import pytest
import torch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.models.quantize import quantize_linear_weights
from functional_pp.parallel import sharding
from functional_pp.quant.codebooks import NF4, dynamic_map, nf4_table
from functional_pp.quant.weights import QuantizedWeight, dequantize, quantize_int8, quantize_nf4, quantized_bytes
from tests.harness import make_batch

CFG = llama.Config.tiny(hidden=512, heads=8, kv_heads=2, mlp=512, layers=1)   # head_dim 64: whole NF4 blocks
DECLS = llama.init(CFG, torch.float32)
FULL = fpp.init_params(DECLS, seed=0)
BATCH = make_batch(CFG, batch=2, seq=8)
LAYOUTS = {"one": (fpp.Mesh(), fpp.Rules()),
           "fsdp": (fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard")),
           "tp": (fpp.Mesh(tp=2), fpp.Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp"))}


def _is_q(x):
    return isinstance(x, QuantizedWeight)


def dequantized(tree):
    return optree.tree_map(lambda x: dequantize(x) if _is_q(x) else x, tree, is_leaf=_is_q, none_is_leaf=False)


@pytest.fixture(scope="module")
def nf4():
    return quantize_linear_weights(FULL, DECLS, "nf4", double_quant=True)


def test_nf4_table_is_the_published_one():
    bnb = pytest.importorskip("bitsandbytes.functional")
    assert torch.equal(nf4_table(), bnb.get_4bit_type("nf4", "cpu"))
    assert NF4[0] == -1.0 and NF4[7] == 0.0 and NF4[15] == 1.0 and NF4[8] == 0.07958029955625534  # QLoRA, App. E


def test_nf4_codes_and_scales_equal_bitsandbytes_quantize_4bit():
    bnb = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(4, 64 * 256, generator=torch.Generator().manual_seed(0)) * 0.02
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    q = quantize_nf4(w, -1, double_quant=False)
    assert torch.equal(q.codes.reshape(-1), packed.reshape(-1)) and torch.equal(q.absmax.reshape(-1), state.absmax)
    assert torch.equal(dequantize(q), bnb.dequantize_4bit(packed, state))
    # double quantization: the scales centred on their mean, 8-bit in blocks of 256 with the signed
    # dynamic map: bitsandbytes' composition with its reference blockwise kernel (its native CPU one
    # does not round to the nearest code: tests/optim/test_adam8bit.py)
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    offset = state.absmax.mean()
    codes, absmax2 = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
        keys, state.absmax - offset, dynamic_map(True), 256)
    d = quantize_nf4(w, -1, double_quant=True)
    assert torch.equal(d.absmax.reshape(-1), codes) and torch.equal(d.absmax2.reshape(-1), absmax2)
    assert torch.equal(d.offset, offset) and d.absmax.dtype == torch.uint8


def test_blocks_along_another_dimension_are_the_hugging_face_weights_blocks():
    w = torch.randn(128, 4, 16, generator=torch.Generator().manual_seed(1))    # hidden heads head_dim
    hf = w.permute(1, 2, 0).reshape(64, 128)                                     # (out, in) = (heads*head_dim, hidden)
    ours, theirs = quantize_nf4(w, 0, double_quant=False), quantize_nf4(hf, -1, double_quant=False)
    assert ours.codes.shape == (64, 4, 16) and ours.absmax.shape == (2, 4, 16) and ours.block_dim == 0
    assert torch.equal(dequantize(ours).permute(1, 2, 0).reshape(64, 128), dequantize(theirs))


def test_int8_blockwise_absmax_error_is_half_a_step():
    w = torch.randn(256, 96, generator=torch.Generator().manual_seed(2))
    q = quantize_int8(w, 0)
    assert q.codes.dtype == torch.int8 and q.absmax.shape == (4, 96) and q.kind == "int8"
    step = q.absmax.repeat_interleave(64, 0) / 127
    assert ((dequantize(q) - w).abs() <= step / 2 + 1e-7).all()
    assert q.codes.abs().max() == 127


def test_linear_weights_are_quantized_and_the_rest_kept(nf4):
    params, decls = nf4
    kept = {p for p, x in fpp.leaves_with_paths(DECLS)} - {p for p, _ in fpp.leaves_with_paths(decls)}
    assert all(_is_q(params["layers"][0]["self_attn"][k]) for k in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert all(_is_q(params["layers"][0]["mlp"][k]) for k in ("gate_proj", "up_proj", "down_proj"))
    assert {p.rsplit(".", 1)[-1] for p in kept} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                    "up_proj", "down_proj"}
    assert params["embed_tokens"] is FULL["embed_tokens"] and params["norm"] is FULL["norm"]
    o = params["layers"][0]["self_attn"]["o_proj"]        # heads head_dim hidden: blocks along head_dim
    assert o.codes.shape == (8, 32, 512) and o.block_dim == 1
    numel = sum(x.numel() for p, x in fpp.leaves_with_paths(FULL) if p.rsplit(".", 1)[-1] in (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    nbytes = sum(quantized_bytes(x) for x in optree.tree_leaves(params, is_leaf=_is_q) if _is_q(x))
    assert nbytes < 0.27 * 2 * numel                  # about 4x less than bf16: 0.5 + 1/64 + ... bytes each
    tiny = llama.init(llama.Config.tiny(), torch.float32)         # head_dim 16: no whole block of 64 along it
    qp, qd = quantize_linear_weights(fpp.init_params(tiny, seed=0), tiny, "nf4")
    o, q = qp["layers"][0]["self_attn"]["o_proj"], qp["layers"][0]["self_attn"]["q_proj"]
    assert o.flat and not q.flat       # o_proj in bitsandbytes' flat form (tests/models/test_quantize_any_shape.py)


def _forward(layout, tree, decls, processes=False, simulate=None):
    mesh, rules = LAYOUTS[layout]

    def fn():
        with fpp.use_rules(rules):
            local = fpp.per_device(lambda: sharding.shard(tree, decls, mesh, rules, fpp.current_rank()))
            named = sharding.named_tree(local, decls)
            batch = {k: fpp.named(v, "batch seq") for k, v in BATCH.items()}
            with fpp.comm_report() as rep:
                loss = llama.loss(named, batch, CFG).value()
        return loss.detach(), [(e.kind, e.bytes_sent, e.dtype) for e in rep.events]
    kw = {"processes": True, "timeout": 300} if processes else {"simulate": simulate} if simulate else {}
    return fpp.launch(fn, mesh, **kw)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_forward_with_nf4_weights_equals_the_dequantized_weights_forward(layout, nf4):
    params, decls = nf4
    quantized, plain = _forward(layout, params, decls), _forward(layout, dequantized(params), DECLS)
    for (a, _), (b, _) in zip(quantized, plain):
        assert torch.equal(a, b)
    if layout == "fsdp":
        # FSDP all-gathers the quantized components: (n-1)/n of the bytes of every leaf split on hidden
        def gathered(tree, decls):
            leaves = zip(optree.tree_leaves(tree, none_is_leaf=False), optree.tree_leaves(decls, none_is_leaf=False))
            return sum(x.numel() * x.element_size() for x, d in leaves if "hidden" in d.dims) // 2
        for (_, events), want in ((quantized[0], gathered(params, decls)), (plain[0], gathered(dequantized(params), DECLS))):
            assert sum(b for k, b, _ in events if k == "all_gather") == want
        assert {t for k, _, t in quantized[0][1] if k == "all_gather"} == {"uint8", "float32"}


def test_int8_forward_equals_the_dequantized_weights_forward_under_fsdp():
    params, decls = quantize_linear_weights(FULL, DECLS, "int8")
    for (a, _), (b, _) in zip(_forward("fsdp", params, decls), _forward("fsdp", dequantized(params), DECLS)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_batched_simulation_of_nf4_weights_equals_the_threaded_one(layout, nf4):
    params, decls = nf4
    for (a, _), (b, _) in zip(_forward(layout, params, decls, simulate="batched"), _forward(layout, params, decls)):
        assert torch.equal(a, b)


@pytest.mark.multiprocess
def test_nf4_fsdp_forward_on_two_gloo_processes_equals_simulation(nf4):
    params, decls = nf4
    for (a, ea), (b, eb) in zip(_forward("fsdp", params, decls, processes=True), _forward("fsdp", params, decls)):
        assert torch.equal(a, b) and ea == eb


def test_config_reads_qlora_as_an_nf4_base():
    from functional_pp.config import TrainConfig
    qlora = TrainConfig.from_dict({"adapter": "qlora", "lora_target_linear": True})
    assert qlora.base_quantization() == {"kind": "nf4", "double_quant": True, "experts": False}
    plain = TrainConfig.from_dict({"adapter": "lora", "lora_target_linear": True, "load_in_4bit": True,
                                   "bnb_config_kwargs": {"bnb_4bit_use_double_quant": False,
                                                         "bnb_4bit_quant_type": "nf4"}})
    assert plain.base_quantization() == {"kind": "nf4", "double_quant": False, "experts": False}


@pytest.mark.parametrize("layout", ["one", "fsdp"])
def test_gradients_through_nf4_weights_equal_the_dequantized_weights_gradients(layout, nf4):
    # QLoRA trains around a frozen base: the gradients of everything else flow through its matmuls
    params, decls = nf4
    mesh, rules = LAYOUTS[layout]
    linear = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    def grads(tree, decls):
        def fn():
            with fpp.use_rules(rules):
                local = fpp.map_with_path(
                    lambda p, x: x.clone().requires_grad_(x.is_floating_point() and not linear & set(p.split("."))),
                    sharding.shard(tree, decls, mesh, rules, fpp.current_rank()))
                batch = {k: fpp.named(v, "batch seq") for k, v in BATCH.items()}
                llama.loss(sharding.named_tree(local, decls), batch, CFG).value().backward()
            return {p: x.grad for p, x in fpp.leaves_with_paths(local) if x.grad is not None}
        return fpp.launch(fn, mesh)
    quantized, plain = grads(params, decls), grads(dequantized(params), DECLS)
    for a, b in zip(quantized, plain):
        assert a.keys() == b.keys() and "embed_tokens" in a and "norm" in a
        assert all(torch.equal(a[p], b[p]) for p in a)
