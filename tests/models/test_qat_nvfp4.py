"""QAT with ``weight_dtype: nvfp4``, ``activation_dtype: nvfp4`` (issue 47), checked against
torchao 0.18, which Axolotl delegates to: the round trip equals ``NVFP4Tensor.to_nvfp4(x,
per_tensor_scale).dequantize()`` bit for bit on CPU; a tiny Llama under our QAT gives the logits
and every gradient of the transformers model prepared by ``quantize_(model,
QATConfig(NVFP4DynamicActivationNVFP4WeightConfig(), step="prepare"))``, whose forward multiplies
NVFP4 operands with ``torch._scaled_mm`` (CUDA, Blackwell only): here that one call is emulated by
the product of torchao's own dequantized operands in fp32 (what the kernel computes, up to the
order of its fp32 sums); FSDP x TP (simulated) and FSDP on two gloo processes equal one device
(the per-tensor scales a max over every device's part); bad options refused by name."""

import pytest
import torch
from harness import tokens

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.core.layout import block_slices
from functional_pp.models import llama
from functional_pp.ops import fake_quant
from functional_pp.parallel import sharding
from functional_pp.parallel.named import settle
from functional_pp.quant import fp4

transformers = pytest.importorskip("transformers")
nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
torchao_qat = pytest.importorskip("torchao.prototype.qat.nvfp4")

CFG = fake_quant.QatConfig(weight_dtype="nvfp4", activation_dtype="nvfp4", group_size=16)
BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=128)


def _torchao_round_trip(x: torch.Tensor) -> torch.Tensor:
    scale = nvfp4_tensor.per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    return nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(x.dtype)


def test_round_trip_equals_torchaos_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        wide = torch.randn(48, 128, generator=g) * torch.exp(3 * torch.randn(48, 1, generator=g))
        ties = torch.randint(-24, 25, (48, 128), generator=g) / 4          # values on E2M1's midpoints
        wide[0, :16] = 0.0                                                 # an all-zero block
        for x in (wide.to(dtype), ties.to(dtype)):
            want = _torchao_round_trip(x)
            got = fp4.nvfp4_round_trip(x, fp4.nvfp4_per_tensor_scale(x.abs().max()))
            assert torch.equal(got.view(bits), want.view(bits)) and not torch.equal(got, x)
    x = torch.randn(8, 32, generator=g, requires_grad=True)
    y = fake_quant.fake_quant_nvfp4(x, fp4.nvfp4_per_tensor_scale(x.detach().abs().max()))
    up = torch.randn(8, 32, generator=g)
    (y * up).sum().backward()
    assert torch.equal(x.grad, up)                 # straight through


def _emulated_scaled_mm(a, b, aten_op, bias=None):
    """torchao's ``_addmm_nvfp4_dispatch`` with ``torch._scaled_mm`` (CUDA) replaced by the product
    of the dequantized operands in fp32, cast as it casts its output."""
    out = (a.dequantize(torch.float32) @ b.dequantize(torch.float32)).to(a.orig_dtype)
    return out if bias is None else out + bias.to(a.orig_dtype)


@pytest.fixture(scope="module")
def torchao_model(tmp_path_factory):
    from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d, safe_serialization=True)
    quantize_(model, QATConfig(NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=False), step="prepare"))
    assert isinstance(model.lm_head, torchao_qat.NVFP4FakeQuantizedLinear)
    return model, d


def test_logits_and_gradients_equal_torchaos_nvfp4_qat_model(torchao_model, monkeypatch, tmp_path):
    monkeypatch.setattr(torchao_qat, "_addmm_nvfp4_dispatch", _emulated_scaled_mm)
    model, d = torchao_model
    model.zero_grad()
    from harness import assert_fake_quant_equals_hf
    assert_fake_quant_equals_hf(model, d, CFG, tmp_path, acts_by=1e-2)


def test_sharded_fsdp_tp_logits_equal_one_device(torchao_model):
    _, d = torchao_model
    toks = tokens(batch=2, seq=12)
    cfg, full = hf.load_hf_llama(d)
    decls = llama.init(cfg)
    with torch.no_grad():
        want = fake_quant.adapt(llama.forward, CFG)(sharding.named_tree(full, decls), fpp.wrap(toks, "batch seq"),
                                                    cfg).value()
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()

    def device():
        with fpp.use_rules(rules):
            local = sharding.shard(full, decls, mesh, rules, fpp.current_rank())
            with torch.no_grad():
                logits = settle(fake_quant.adapt(llama.forward, CFG)(sharding.named_tree(local, decls),
                                                                     fpp.named(toks, "batch seq"), cfg))
            region = block_slices(tuple(want.shape), logits.split, mesh, fpp.current_rank())
            torch.testing.assert_close(logits.data, want[region], atol=1e-5, rtol=1e-5)
    fpp.launch(device, mesh)


@pytest.mark.multiprocess
def test_fsdp_on_two_gloo_processes_equals_one_device():
    from harness import assert_same_run, launch_steps
    cfg = llama.Config.tiny()
    kw = dict(steps=2, dtype=torch.float64, opt=fpp.optim.adamw(1e-2), rules=llama.default_rules(tp=False),
              wrap_loss=lambda f: fake_quant.adapt(f, CFG))
    (one,) = launch_steps(cfg, **kw)
    for run in launch_steps(cfg, mesh=fpp.Mesh(dp_shard=2), processes=True, **kw):
        assert_same_run(run, one, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("qat,match", [
    ({"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 32}, "NVFP4's blocks are 16"),
    ({"weight_dtype": "nvfp4", "activation_dtype": "int8", "group_size": 16}, "weight_dtype nvfp4, activation_dtype int8"),
    ({"weight_dtype": "nvfp4", "group_size": 16}, "weight_dtype nvfp4, activation_dtype None"),
])
def test_bad_nvfp4_options_are_refused(qat, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_dict({"qat": qat})


def test_axolotls_nvfp4_block_is_accepted():
    q = TrainConfig.from_dict({"qat": {"weight_dtype": "nvfp4", "activation_dtype": "nvfp4",
                                       "group_size": 16}}).qat_config()
    assert (q.weight_dtype, q.activation_dtype, q.group_size) == ("nvfp4", "nvfp4", 16)
