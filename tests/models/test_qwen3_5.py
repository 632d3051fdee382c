"""Qwen3.5 (``qwen3_5_text``, and the text decoder of the multimodal ``qwen3_5``) as a configuration
of the one decoder (models/llama.py, models/gated_deltanet.py, models/qwen3_5_hf.py): Gated
DeltaNet layers beside full-attention layers whose q_proj holds each head's output gate. A tiny
random model transformers builds from a config loads through the HF import (in_proj_qkv and the
convolution split into q / k / v); logits, loss and every gradient equal transformers'; export
writes ``Qwen3_5ForCausalLM``, which loads with equal logits; LoRA on Axolotl's targets equals
peft; FSDP x TP with sequence parallelism on simulated devices and FSDP x TP on real gloo
processes, and CP x TP (plain and packed rows) on simulated devices equal one device; the k/v cache
is refused by name."""
import dataclasses
import json

import pytest
import torch
from harness import (assert_1f1b_equals_one_device, assert_cp_equals_one_device, assert_export_round_trip,
                     assert_hf_layout_equals_one_device, assert_lora_step_equals_peft,
                     assert_nf4_base_equals_bitsandbytes, assert_packed_documents_equal_hf, fp64_beside_hf,
                     import_logits_beside_hf, our_logits, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("transformers without Qwen3.5", allow_module_level=True)

# 2 key heads serving 4 value heads; value heads narrower than key heads; one full-attention layer of three
CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention", "linear_attention"], initializer_range=0.2,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=128)
EAGER = dict(attn_implementation="eager")


def _randomize(model) -> None:
    """The norms and dt_bias off their initial values (so a wrong offset or a missing bias shows)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn_like(p))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**CONFIG)).float().eval()
    _randomize(model)
    d = tmp_path_factory.mktemp("qwen3_5_text")
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = "eager"
    return model, d


def test_config_reads_qwen3_5_text(saved):
    cfg = hf.config_from_hf(saved[1])
    assert (cfg.model_type, cfg.layer_types, cfg.q_gate, cfg.qk_norm, cfg.norm_offset) == (
        "qwen3_5_text", ("linear_attention", "full_attention", "linear_attention"), True, True, 1.0)
    assert (cfg.linear_heads, cfg.linear_kv_heads, cfg.linear_head_dim, cfg.linear_v_head_dim,
            cfg.linear_conv_kernel, cfg.partial_rotary_factor) == (4, 2, 8, 6, 4, 0.25)
    decls = dict(tree.leaves_with_paths(llama.init(cfg)))
    assert "layers.0.self_attn.q_proj" not in decls and decls["layers.1.self_attn.q_proj"].shape == (32, 4, 16)
    assert decls["layers.0.linear_attn.conv_v"].shape == (4, 6, 4)


def test_import_logits_equal_transformers(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved, atol=3e-5)
    # the gate and the partial rotary change the result (so the equality above covers them)
    for change in (dict(partial_rotary_factor=0.5), dict(norm_eps=1e-2)):
        assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, **change), toks), want, atol=1e-3), change


def test_loss_and_gradients_equal_transformers(saved):
    """float64 (transformers computes the delta rule and the norms in float32: equal to its precision)."""
    _, d = saved
    model, cfg, loss, grads, out, want = fp64_beside_hf(d, **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    fused = hf.save_hf_llama(grads, cfg, d.parent / "grads")          # (in_proj_qkv and conv1d fused again)
    from safetensors.torch import load_file
    files = load_file(str(fused / "model.safetensors"))
    assert ours["layers.0.linear_attn.A_log"].abs().max() > 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(files[name], p.grad, rtol=1e-3, atol=1e-4 * p.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "qwen3_5_text", "Qwen3_5ForCausalLM", atol=5e-5,
                             **EAGER)


def test_lora_on_axolotls_targets_equals_peft(saved):
    """Axolotl's Qwen3.5 targets (attention's q/k/v/o, the MLP's up/down) and the linear attention's
    z gate and output projection (``linear_attn.in_proj_z`` / ``out_proj``)."""
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(saved[1], dtype=torch.float32, **EAGER)
    assert_lora_step_equals_peft(model, saved[1], ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "up_proj",
                                                   "in_proj_z", "out_proj"], count=2 * (4 + 2 * 3 + 2 * 2))


def test_packed_documents_equal_transformers_on_each(saved):
    """Packed rows (``segments``, Axolotl's sample_packing): each document's logits equal transformers'
    logits of that document alone (the convolution and the recurrence restart, attention stays inside)."""
    assert_packed_documents_equal_hf(*saved)


def test_fsdp_tp_sp_equals_one_device(saved):
    """FSDP x TP with sequence parallelism: the value and key heads of the linear layers over tp (the
    convolution's channels with them), the sequence gathered before each mixer."""
    assert_hf_layout_equals_one_device(saved[1], "fsdp_tp_sp")


def test_fsdp_tp_on_real_processes_equal_one_device(saved):
    from harness import assert_processes_equal_one_device
    assert_processes_equal_one_device(hf.config_from_hf(saved[1]))


def test_context_parallelism_equals_one_device(saved):
    """The Gated DeltaNet layers under CP 2 x TP 2 (the convolution's halo and the rule's state handed from
    block to block, ops/sequence_chain.py), plain and packed rows."""
    assert_cp_equals_one_device(saved[1])
    assert_cp_equals_one_device(saved[1], rules=llama.default_rules(sequence_parallel=True))     # (SP: res_seq over cp x tp)


def test_refusals_name_the_option(saved, tmp_path):
    cfg, params = hf.load_hf_llama(saved[1])
    from functional_pp.parallel import sharding
    named = sharding.named_tree(params, llama.init(cfg))
    toks = fpp.wrap(tokens(batch=2), "batch seq")
    with pytest.raises(ValueError, match=r"key / value cache does not support linear_attention"):
        from functional_pp.models import sampling
        sampling.generate(lambda p, t: llama.forward(p, t, cfg), named, tokens(batch=1, seq=4), max_new_tokens=2)
    conf = json.loads((saved[1] / "config.json").read_text())
    for key, value, what in (("attention_bias", True, "has no biases"), ("attention_dropout", 0.1, "set it to 0.0"),
                             ("layer_types", ["linear_attention"] * 2, "must be 3 entries"),
                             ("linear_num_value_heads", 3, "must be a multiple of linear_kv_heads=2")):
        with pytest.raises(ck.CheckpointMismatchError, match=rf"HF qwen3_5_text config: .*{what}"):
            hf.config_from_hf(dict(conf, **{key: value}))
    with pytest.raises(ck.CheckpointMismatchError, match=r"export as 'qwen3_5_text': q_gate=False has no"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, q_gate=False), tmp_path / "no")
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"export as 'qwen3': .*Gated DeltaNet layers.*choose model_type qwen3_5_text"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, model_type="qwen3", q_gate=False), tmp_path / "no")


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A tiny ``Qwen3_5ForConditionalGeneration`` (a one-block vision tower beside the text decoder)."""
    torch.manual_seed(1)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    conf = transformers.Qwen3_5Config(text_config=CONFIG, vision_config=vision, image_token_id=250,
                                      video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    model = transformers.Qwen3_5ForConditionalGeneration(conf).float().eval()
    _randomize(model)
    d = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(d, safe_serialization=True)
    return model, d


def test_multimodal_checkpoint_loads_its_text_decoder(multimodal, tmp_path):
    """``model_type: qwen3_5``: the text decoder under ``model.language_model.`` loads (the vision
    tower left aside) with transformers' logits of text-only input; export writes it as
    ``Qwen3_5ForCausalLM`` with the same logits."""
    model, d = multimodal
    cfg, params = hf.load_hf_llama(d)
    assert cfg.model_type == "qwen3_5" and cfg.linear_heads == 4
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
    out = hf.save_hf_llama(params, cfg, tmp_path / "text")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **EAGER)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=toks).logits, want, atol=1e-5, rtol=1e-5)


def test_pipeline_stages_equal_one_device():
    """The layers over pp = 2 (1F1B, four micro-batches; each stage a linear-attention and a full
    layer): two AdamW steps give one device's losses."""
    cfg = llama.Config(model_type="qwen3_5_text", vocab=256, hidden=32, layers=4, heads=4, kv_heads=2, head_dim=8,
                       mlp=64, rope_theta=10000.0, rope_scaling=None, q_gate=True, qk_norm=True, norm_offset=1.0,
                       partial_rotary_factor=0.25, linear_heads=4, linear_kv_heads=2, linear_head_dim=8,
                       linear_v_head_dim=6, layer_types=("linear_attention", "full_attention") * 2)
    one = assert_1f1b_equals_one_device(cfg, lr=3e-2, rtol=1e-12, atol=1e-13)
    assert one[1] < one[0]


def test_context_parallelism_validates_and_the_batched_simulator_names_the_layers(saved, tmp_path, capsys):
    """``cp_size: 2`` with a Qwen3.5 base model validates; the batched simulator (every device at once)
    and torch.compile cannot run the chain of blocks yet: refused before any work, naming the layers and
    the fix."""
    import yaml

    from functional_pp import cli
    conf = {"base_model": str(saved[1]), "micro_batch_size": 1, "sequence_len": 32, "max_steps": 1,
            "data": {"max_bytes": 20_000}, "logging": {"output_dir": str(tmp_path / "out")}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(conf, cp_size=2)))
    assert cli.main(["validate", str(path), "--simulate", "2"]) == 0
    assert cli.main(["train", str(path), "--simulate", "2", "--sim-mode", "batched"]) == 2
    err = capsys.readouterr().err
    assert "layers [0, 2] are linear_attention (Gated DeltaNet)" in err and "simulation: threaded" in err
    assert not (tmp_path / "out").exists()
    path.write_text(yaml.safe_dump(dict(conf, cp_size=2, compile=True)))      # (nor does torch.compile trace it yet)
    assert cli.main(["validate", str(path), "--simulate", "2"]) == 2
    assert "is not traced by torch.compile yet; use compile: false, or cp_size 1" in capsys.readouterr().err
    from functional_pp.cli.plan import config_space          # (plan / layout: auto search cp for it too: the
    from functional_pp.config import TrainConfig             # time model runs the chain serially)
    long = dict(conf, sequence_len=4096, max_steps=1)
    assert config_space(TrainConfig.from_dict(long)).max_axis["cp"] == 4


def test_compiled_step_equals_eager(saved):
    """The whole step compiled (aot_eager, the native trace: the chunk loop unrolled) trains as eager."""
    from harness import assert_same_run, launch_steps
    cfg = hf.config_from_hf(saved[1])
    assert_same_run(launch_steps(cfg, loss_as_traced=True)[0],       # (eager too the loss as traced)
                    launch_steps(cfg, compile="aot_eager", loss_as_traced=True)[0], rtol=1e-5, atol=1e-6)


def test_nf4_base_equals_transformers_with_bitsandbytes(tmp_path):
    """QLoRA's base (``load_in_4bit``, NF4): every linear of the Gated DeltaNet layers (in_proj_qkv's
    parts, in_proj_z / b / a, out_proj), of the gated attention and of the MLP quantized as
    transformers + bitsandbytes quantize them gives the same logits. Sizes hold whole blocks of 64."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    conf = dict(CONFIG, hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64,
                linear_value_head_dim=64, initializer_range=0.1)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**conf)).float().eval()
    qp = assert_nf4_base_equals_bitsandbytes(model, tmp_path, **EAGER)
    assert type(qp["layers"][0]["linear_attn"]["out_proj"]).__name__ == "QuantizedWeight"


def test_adapters_of_the_fused_in_proj_qkv_export_as_one_peft_adapter(saved, tmp_path):
    """Axolotl's optional ``linear_attn.in_proj_qkv`` target names its parts (in_proj_q / k / v, an
    adapter each); the PEFT directory holds one exact adapter of the fused module (A stacked, B
    block-diagonal), which peft loads on ``Qwen3_5ForCausalLM`` with our logits."""
    import peft

    from functional_pp import adapters
    from functional_pp.adapters import peft_dir
    from functional_pp.adapters.peft_fused import part_names
    from harness import adapted_logits, random_lora
    model, d = saved
    cfg = hf.config_from_hf(d)
    names = part_names(["linear_attn.in_proj_qkv", "linear_attn.out_proj", "q_proj"], "qwen3_5_text")
    assert names == ("linear_attn.in_proj_q", "linear_attn.in_proj_k", "linear_attn.in_proj_v", "linear_attn.out_proj",
                     "q_proj")
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=names)
    decls, base = adapters.init(llama.init(cfg), lc), hf.load_hf_params(d, cfg)
    lora = random_lora(decls, torch.Generator().manual_seed(1))
    toks = tokens(batch=2)
    ours = adapted_logits(base, lora, decls, lc, cfg, toks)
    out = peft_dir.save_adapter(tmp_path / "adapter", lora, lc, str(d), base=base)
    conf = json.loads((out / "adapter_config.json").read_text())
    assert "in_proj_qkv" in conf["target_modules"] and "in_proj_q" not in conf["target_modules"]
    plain = transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32, **EAGER)
    loaded = peft.PeftModel.from_pretrained(transformers.Qwen3_5ForCausalLM.from_pretrained(
        d, dtype=torch.float32, **EAGER), str(out)).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=toks).logits
        assert (theirs - plain(input_ids=toks).logits).abs().max() > 1e-3
    torch.testing.assert_close(ours, theirs, atol=3e-5, rtol=1e-5)


def test_packed_documents_under_fsdp_tp_sp_equal_one_device(saved):
    """Packed rows (``segments``) under FSDP x TP with sequence parallelism: the document ids laid
    out with the batch, the loss and every gradient equal one device's."""
    from harness import make_batch, parallel, single_device
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    batch["segments"] = torch.tensor([[0] * 5 + [1] * 7, [2] * 12, [3] * 3 + [4] * 9, [5] * 8 + [6] * 4])
    loss, grads = single_device(cfg, params, batch)
    unpacked, _ = single_device(cfg, params, {k: v for k, v in batch.items() if k != "segments"})
    assert abs(float(loss) - float(unpacked)) > 1e-4                     # (the documents are kept apart)
    p_loss, p_grads, _ = parallel(cfg, params, batch, fpp.Mesh(dp_shard=2, tp=2),
                                  llama.default_rules(sequence_parallel=True))[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def test_flops_per_token_of_a_gated_deltanet_layer_match_the_counted_ones():
    """MFU's count of a Gated DeltaNet mixer (``gated_deltanet.flops``: projections and the chunked
    rule's matmuls) within 10% of torch's FlopCounterMode on its forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from functional_pp.models import gated_deltanet
    cfg = llama.Config(model_type="qwen3_5_text", vocab=256, hidden=256, layers=1, heads=4, kv_heads=2, head_dim=64,
                       mlp=64, rope_scaling=None, q_gate=True, qk_norm=True, norm_offset=1.0, linear_heads=8,
                       linear_kv_heads=4, linear_head_dim=64, linear_v_head_dim=64, layer_types=("linear_attention",))
    p = fpp.init(lambda: llama.init(cfg), seed=0)
    seq = 256
    with FlopCounterMode(display=False) as counted:
        gated_deltanet.mixer(p["layers"][0]["linear_attn"], fpp.wrap(torch.randn(2, seq, 256), "batch seq hidden"), cfg)
    assert gated_deltanet.flops(cfg, seq) == pytest.approx(counted.get_total_flops() / (2 * seq), rel=0.1)
