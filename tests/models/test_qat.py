"""Quantization-aware training (Axolotl's ``qat:``, issue 47) checked against torchao, which
Axolotl delegates to: the fake quantizers equal torchao's (values and gradients); a tiny Llama
under our QAT gives the logits and gradients of the same transformers model prepared as Axolotl
prepares it (``quantize_(model, QATConfig(Int4WeightFakeQuantizeConfig(group_size, bf16),
IntxFakeQuantizeConfig(int8, per_token, asymmetric)))``), on one device and sharded (FSDP x TP);
``fake_quant_after_n_steps`` leaves the first steps unquantized; bad options are refused."""
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

transformers = pytest.importorskip("transformers")
qat_api = pytest.importorskip("torchao.quantization.qat")

GROUP = 32
CFG = fake_quant.QatConfig(group_size=GROUP)
BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=128)


def _torchao_qat(model):
    """Axolotl's prepare_model_for_qat for weight_dtype int4, activation_dtype int8."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat.fake_quantize_config import Int4WeightFakeQuantizeConfig, IntxFakeQuantizeConfig
    quantize_(model, qat_api.QATConfig(
        weight_config=Int4WeightFakeQuantizeConfig(group_size=GROUP, activation_dtype=torch.bfloat16),
        activation_config=IntxFakeQuantizeConfig(dtype=torch.int8, granularity="per_token", is_symmetric=False)))
    return model


def _hf(tmp_path, tied):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, tie_word_embeddings=tied)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path, safe_serialization=True)
    return _torchao_qat(model)


def test_fake_quantizers_equal_torchaos_values_and_gradients():
    from torchao.quantization.qat.fake_quantize_config import Int4WeightFakeQuantizeConfig, IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import Int4WeightFakeQuantizer, IntxFakeQuantizer
    g = torch.Generator().manual_seed(0)
    for ours, theirs, shape in (
            (lambda t: fake_quant.fake_quant_int4_weight(t, GROUP),
             Int4WeightFakeQuantizer(Int4WeightFakeQuantizeConfig(group_size=GROUP, activation_dtype=torch.bfloat16)),
             (48, 128)),
            (fake_quant.fake_quant_int8_tokens,
             IntxFakeQuantizer(IntxFakeQuantizeConfig(dtype=torch.int8, granularity="per_token", is_symmetric=False)),
             (35, 128))):
        x = (3 * torch.randn(shape, generator=g)).requires_grad_()
        y = x.detach().clone().requires_grad_()
        a, b = ours(x), theirs(y)
        assert torch.equal(a, b) and not torch.equal(a, x)
        up = torch.randn(shape, generator=g)
        (a * up).sum().backward()
        (b * up).sum().backward()
        assert torch.equal(x.grad, y.grad)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_gradients_equal_torchaos_qat_model(tmp_path, tied):
    model = _hf(tmp_path, tied)
    from harness import assert_fake_quant_equals_hf
    assert_fake_quant_equals_hf(model, tmp_path, CFG, tmp_path, acts_by=1e-3)


def test_sharded_fsdp_tp_logits_equal_one_device(tmp_path):
    model = _hf(tmp_path, False)
    toks = tokens(batch=2, seq=12)
    with torch.no_grad():
        want = model(input_ids=toks).logits
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()
    cfg, full = hf.load_hf_llama(tmp_path)
    decls = llama.init(cfg)

    def device():
        with fpp.use_rules(rules):
            local = sharding.shard(full, decls, mesh, rules, fpp.current_rank())
            with torch.no_grad():
                logits = settle(fake_quant.adapt(llama.forward, CFG)(sharding.named_tree(local, decls),
                                                                     fpp.named(toks, "batch seq"), cfg))
            region = block_slices(tuple(want.shape), logits.split, mesh, fpp.current_rank())
            torch.testing.assert_close(logits.data, want[region], atol=2e-5, rtol=1e-5)
    fpp.launch(device, mesh)


def test_off_until_fake_quant_after_n_steps(tmp_path):
    _hf(tmp_path, False)
    cfg, full = hf.load_hf_llama(tmp_path)
    decls = llama.init(cfg)
    toks = tokens(batch=2, seq=12)
    plain = llama.forward(sharding.named_tree(full, decls), fpp.wrap(toks, "batch seq"), cfg).value()
    fake_quant.set_enabled(False)
    try:
        off = fake_quant.adapt(llama.forward, CFG)(sharding.named_tree(full, decls), fpp.wrap(toks, "batch seq"), cfg)
    finally:
        fake_quant.set_enabled(True)
    assert torch.equal(off.value(), plain)


@pytest.mark.parametrize("qat,match", [
    ({"weight_dtype": "int4", "activation_dtype": "nvfp4", "group_size": 16}, "qat: weight_dtype int4, activation_dtype nvfp4"),
    ({"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 0}, "qat.group_size"),
    ({"weight_dtype": "int4", "activation_dtype": "int8", "quantize_embedding": True}, "qat.quantize_embedding"),
    ({"weight_dtype": "int4", "activation_dtype": "int8", "bits": 4}, "qat.bits is not a QAT option"),
])
def test_bad_qat_options_are_refused(qat, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_dict({"qat": qat})


def test_a_group_size_not_dividing_the_inputs_is_refused_with_the_sizes(tmp_path):
    _hf(tmp_path, False)
    cfg, full = hf.load_hf_llama(tmp_path)
    with pytest.raises(ValueError, match=r"qat: layers.0.self_attn.q_proj: 64 input features .*qat.group_size 48"):
        fake_quant.adapt(llama.forward, fake_quant.QatConfig(group_size=48))(
            sharding.named_tree(full, llama.init(cfg)), fpp.wrap(tokens(batch=1, seq=4), "batch seq"), cfg)


@pytest.mark.multiprocess
def test_fsdp_on_two_gloo_processes_equals_simulated_and_one_device():
    from harness import assert_same_run, launch_steps
    cfg = llama.Config.tiny()
    kw = dict(steps=2, dtype=torch.float64, opt=fpp.optim.adamw(1e-2), rules=llama.default_rules(tp=False),
              wrap_loss=lambda f: fake_quant.adapt(f, fake_quant.QatConfig(group_size=16)))
    (one,) = launch_steps(cfg, **kw)
    for processes in (True, False):
        for run in launch_steps(cfg, mesh=fpp.Mesh(dp_shard=2), processes=processes, **kw):
            assert_same_run(run, one, rtol=1e-4, atol=2e-5)
    assert one[0][1] < one[0][0]


def _losses(tmp_path, name, devices=2, **keys):
    import json

    import yaml

    from functional_pp import cli
    cfg = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "lr_scheduler": "constant",
           "max_steps": 3, "model": "tiny", "data": {"max_bytes": 30_000}, "logging_steps": 1,
           "output_dir": str(tmp_path / name), **keys}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", str(path), "--simulate", str(devices)]) == 0
    return [m["loss"] for m in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if "loss" in m]


def test_the_run_fake_quantizes_from_the_step_after_fake_quant_after_n_steps(tmp_path, capsys):
    qat = {"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 16}
    plain = _losses(tmp_path, "plain")
    late = _losses(tmp_path, "late", qat={**qat, "fake_quant_after_n_steps": 2})
    always = _losses(tmp_path, "always", qat=qat)
    assert "qat:        linear weights and the head fake-quantized after 2 steps" in capsys.readouterr().out
    assert late[:2] == plain[:2] and late[2] != plain[2]       # steps 1-2 as without QAT, step 3 with it
    assert always[0] != plain[0]


def test_a_pipeline_run_fake_quantizes_as_one_device(tmp_path):
    keys = dict(qat={"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 16},
                gradient_accumulation_steps=2, max_steps=2)
    one = _losses(tmp_path, "one", devices=1, **keys)
    pipeline = _losses(tmp_path, "pp", devices=2, pp_size=2, **keys)
    plain = _losses(tmp_path, "plain", devices=1, **{**keys, "qat": None})
    assert pipeline == pytest.approx(one, rel=1e-5) and one[0] != plain[0]


@pytest.mark.slow
def test_a_compiled_step_is_compiled_again_when_fake_quantization_turns_on(tmp_path):
    keys = dict(qat={"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 16,
                     "fake_quant_after_n_steps": 1}, max_steps=2)
    eager = _losses(tmp_path, "eager", devices=1, **keys)
    compiled = _losses(tmp_path, "compiled", devices=1, compile=True, **keys)
    plain = _losses(tmp_path, "plain", devices=1, **{**keys, "qat": None})
    assert compiled == pytest.approx(eager, rel=1e-4) and eager[0] == plain[0] and eager[1] != plain[1]
