"""Quantized frozen weights of any shape (quant/weights.py "flat form", issue 47): a weight whose
innermost input dimension holds no whole block of 64 (o_proj with head_dim 16 or 96, an
in_features 64 does not divide) is quantized as bitsandbytes quantizes the Hugging Face weight,
``[out, in]`` flattened with the last block padded: codes and scales bit-equal to
bitsandbytes; a forward with such weights equals the dequantized weights' forward on one device,
under FSDP and TP (simulated, and FSDP on two gloo processes); a tiny Llama with head_dim 16 and
96 loaded by transformers + bitsandbytes (``load_in_4bit``) gives our logits."""
from __future__ import annotations

import optree
import pytest
import torch
from harness import tokens

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.models.quantize import FLAT_BLOCKS, FLAT_SCALES, quantize_linear_weights
from functional_pp.parallel import sharding
from functional_pp.quant.blockwise import pack_4bit, unpack_4bit
from functional_pp.quant.codebooks import dynamic_map
from functional_pp.quant.weights import QuantizedWeight, dequantize, hf_order, quantize_int8, quantize_nf4
from tests.harness import make_batch

bnb = pytest.importorskip("bitsandbytes.functional")
_REFERENCE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)

# (functional shape, block dimension): in dims 0..block_dim, out dims after (the Hugging Face weight is [out, in])
SHAPES = [((4, 16, 64), 1),     # o_proj, head_dim 16: rows of 64 inputs, blocks across heads
          ((2, 96, 192), 1),    # o_proj, head_dim 96 (Phi-3-mini's): rows of 192 = 3 blocks, blocks across heads
          ((3, 96, 96), 1),     # rows of 288 inputs: blocks across rows
          ((40, 6, 10), 0),     # q_proj with hidden 40: 2400 entries, the last block padded (2400 = 37.5 blocks)
          ((48, 40), 1)]        # a plain [out, in] weight, 1920 entries = 30 blocks


def _hf(w: torch.Tensor, block_dim: int) -> torch.Tensor:
    """The Hugging Face ``[out, in]`` weight of the functional weight ``w``."""
    hf = hf_order(w, block_dim).contiguous()
    n_in = 1
    for s in w.shape[:block_dim % w.ndim + 1]:
        n_in *= s
    return hf.reshape(-1, n_in)


def _packed_hf(q: QuantizedWeight, block_dim: int) -> torch.Tensor:
    """Our NF4 codes, packed in the Hugging Face weight's flattened order (bitsandbytes')."""
    return pack_4bit(hf_order(unpack_4bit(q.codes), block_dim).reshape(-1))


@pytest.mark.parametrize("shape,block_dim", SHAPES)
def test_flat_nf4_codes_and_scales_equal_bitsandbytes(shape, block_dim):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.02
    hf = _hf(w, block_dim)
    packed, state = bnb.quantize_4bit(hf, blocksize=64, quant_type="nf4", compress_statistics=False)
    q = quantize_nf4(w, block_dim, double_quant=False)
    assert q.flat and q.codes.shape[:-1] == w.shape[:-1] and q.codes.shape[-1] == w.shape[-1] // 2
    assert torch.equal(_packed_hf(q, block_dim), packed.reshape(-1)) and torch.equal(q.absmax, state.absmax)
    # dequantized: bitsandbytes' reference kernel (its native CPU dequantize_4bit disagrees with it where
    # blocks cross rows of [out, in]: 24791 of 27648 entries of the 96 x 288 weight; docs/quantization.md)
    ref = torch.ops.bitsandbytes.dequantize_4bit.default.redispatch(_REFERENCE, packed, state.absmax, 64, "nf4",
                                                                    hf.shape, torch.float32)
    assert torch.equal(_hf(dequantize(q, block_dim=block_dim), block_dim), ref)
    # double quantization: bitsandbytes' compress_statistics (mean, then blocks of 256, the last padded)
    d = quantize_nf4(w, block_dim, double_quant=True)
    offset = state.absmax.mean()
    codes, absmax2 = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
        _REFERENCE, state.absmax - offset, dynamic_map(True), 256)
    assert torch.equal(d.absmax, codes) and torch.equal(d.absmax2, absmax2) and torch.equal(d.offset, offset)


def test_flat_int8_is_blockwise_absmax_of_the_flattened_hugging_face_weight():
    w = torch.randn(3, 96, 96, generator=torch.Generator().manual_seed(3))
    q = quantize_int8(w, 1)
    hf = _hf(w, 1).reshape(-1, 64)                       # 27648 entries: whole blocks of the flattened weight
    assert q.flat and q.codes.shape == w.shape and torch.equal(q.absmax, hf.abs().amax(-1))
    assert torch.equal(_hf(q.codes, 1).reshape(-1, 64), torch.round(hf * (127 / hf.abs().amax(-1, keepdim=True)))
                       .to(torch.int8))
    assert ((dequantize(q, block_dim=1) - w).abs() <= q.absmax.max() / 254 + 1e-7).all()


def test_a_flat_weight_without_its_block_dimension_is_refused_with_the_fix():
    q = quantize_nf4(torch.randn(4, 16, 64), 1)
    with pytest.raises(ValueError, match="needs block_dim"):
        dequantize(q)
    with pytest.raises(ValueError, match="flat form .* blocks of 64"):
        quantize_nf4(torch.randn(4, 16, 64), 1, block=128)
    with pytest.raises(ValueError, match="last dimension, which must be even"):
        quantize_nf4(torch.randn(4, 16, 63), 1)


# head_dim 16: o_proj flat; hidden 128: the blocked weights keep whole blocks on each of 2 FSDP shards
CFG = llama.Config.tiny(layers=1, hidden=128, heads=8, kv_heads=2, mlp=128)
DECLS = llama.init(CFG, torch.float32)
FULL = fpp.init_params(DECLS, seed=0)
BATCH = make_batch(CFG, batch=2, seq=8)
LAYOUTS = {"one": (fpp.Mesh(), fpp.Rules()),
           "fsdp": (fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard")),
           "tp": (fpp.Mesh(tp=2), fpp.Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp"))}


def _is_q(x):
    return isinstance(x, QuantizedWeight)


def _dequantized(tree, decls):
    def one(x, d):
        if not _is_q(x):
            return x
        return dequantize(x, block_dim=d.codes.dims.index(d.absmax.dims[0][len(FLAT_BLOCKS):]) if x.flat else None)
    return optree.tree_map(one, tree, decls, is_leaf=_is_q, none_is_leaf=False)


@pytest.fixture(scope="module", params=["nf4", "int8"])
def quantized(request):
    return quantize_linear_weights(FULL, DECLS, request.param, double_quant=True)


def test_o_proj_is_flat_its_scales_replicated_and_the_rest_blocked(quantized):
    params, decls = quantized
    attn, dattn = params["layers"][0]["self_attn"], decls["layers"][0]["self_attn"]
    assert attn["o_proj"].flat and not attn["q_proj"].flat
    assert dattn["o_proj"].codes.dims == ("heads", "head_dim", "hidden")
    assert dattn["o_proj"].absmax.dims == (FLAT_BLOCKS + "head_dim",)
    if attn["o_proj"].absmax2 is not None:
        assert dattn["o_proj"].absmax2.dims == (FLAT_SCALES,)
    assert torch.equal(_dequantized(params, decls)["layers"][0]["self_attn"]["o_proj"],
                       dequantize(quantize_nf4(FULL["layers"][0]["self_attn"]["o_proj"], 1), block_dim=1)
                       if attn["o_proj"].kind == "nf4" else
                       dequantize(quantize_int8(FULL["layers"][0]["self_attn"]["o_proj"], 1), block_dim=1))


def _forward(layout, tree, decls, processes=False):
    mesh, rules = LAYOUTS[layout]

    def fn():
        with fpp.use_rules(rules):
            local = fpp.per_device(lambda: sharding.shard(tree, decls, mesh, rules, fpp.current_rank()))
            named = sharding.named_tree(local, decls)
            batch = {k: fpp.named(v, "batch seq") for k, v in BATCH.items()}
            with fpp.comm_report() as rep:
                loss = llama.loss(named, batch, CFG).value()
        return loss.detach(), [(e.kind, e.bytes_sent, e.dtype) for e in rep.events]
    return fpp.launch(fn, mesh, **({"processes": True, "timeout": 300} if processes else {}))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_forward_with_flat_weights_equals_the_dequantized_weights_forward(layout, quantized):
    params, decls = quantized
    got, want = _forward(layout, params, decls), _forward(layout, _dequantized(params, decls), DECLS)
    for (a, _), (b, _) in zip(got, want):
        assert torch.equal(a, b)


def test_fsdp_keeps_the_flat_codes_sharded():
    params, decls = quantize_linear_weights(FULL, DECLS, "nf4")
    mesh, rules = LAYOUTS["fsdp"]
    local = sharding.shard(params, decls, mesh, rules, 0)
    o, full = local["layers"][0]["self_attn"]["o_proj"], params["layers"][0]["self_attn"]["o_proj"]
    assert o.codes.shape == (8, 16, 32) and full.codes.shape == (8, 16, 64)     # hidden split: half the bytes
    assert torch.equal(o.absmax, full.absmax)                                    # the scales replicated


@pytest.mark.multiprocess
def test_flat_nf4_fsdp_forward_on_two_gloo_processes_equals_simulation():
    params, decls = quantize_linear_weights(FULL, DECLS, "nf4")
    for (a, ea), (b, eb) in zip(_forward("fsdp", params, decls, processes=True), _forward("fsdp", params, decls)):
        assert torch.equal(a, b) and ea == eb


@pytest.mark.parametrize("head_dim", [16, 96])
def test_logits_equal_transformers_with_bitsandbytes(tmp_path, head_dim):
    transformers = pytest.importorskip("transformers")
    from functional_pp.checkpoint import hf
    heads = 4 if head_dim == 16 else 2          # o_proj's in_features 64 / 192: whole blocks per row (bitsandbytes'
    kw = dict(vocab_size=256, hidden_size=128, num_hidden_layers=1, num_attention_heads=heads,  # CPU kernels
              num_key_value_heads=1, head_dim=head_dim, intermediate_size=256, rope_theta=10000.0,  # agree)
              rms_norm_eps=1e-5, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float().eval()
    model.save_pretrained(tmp_path)
    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=cfg, dtype=torch.float32,
                                                               device_map="cpu").eval()
    theirs.config._attn_implementation = "eager"
    for module in theirs.modules():       # fp32 compute, as asked (tests/models/test_quantize.py: AVX512-BF16)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        want, full = theirs(input_ids=tokens()).logits, model(input_ids=tokens()).logits
    ours_cfg, params = hf.load_hf_llama(tmp_path)
    qp, qd = quantize_linear_weights(params, llama.init(ours_cfg), "nf4", double_quant=False)
    assert qp["layers"][0]["self_attn"]["o_proj"].flat
    with torch.no_grad():
        got = llama.forward(sharding.named_tree(qp, qd), fpp.wrap(tokens(), "batch seq"), ours_cfg).value()
    assert (want - full).abs().max() > 0.02
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
