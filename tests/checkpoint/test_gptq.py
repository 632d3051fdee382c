"""GPTQ checkpoints read dequantized (quant/gptq.py, checkpoint/hf.py; issue 47). No GPTQ library
installs on this CPU without another torch, so the checkpoints are written by the packer of
tests/harness.py (``gptq_quantize``: written from the format's description, independently of the
reader): integer codes, zero points and fp16 scales packed into qweight / qzeros, act-order
``g_idx`` permutations, v1's zero points minus one. The reader must give back
``scale * (code - zero)`` exactly; the model built on those weights is checked against
transformers' Llama and LoRA on it against peft."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from harness import assert_lora_step_equals_peft, gptq_pack, gptq_quantize, gptq_serialized, our_logits, tokens
from safetensors.torch import save_file

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.core.layout import Rules
from functional_pp.quant.gptq import dequantize_gptq, gptq_format

transformers = pytest.importorskip("transformers")

KW = dict(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
          tie_word_embeddings=False)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("desc_act", [True, False])
def test_dequantize_recovers_scale_times_code_minus_zero(bits, v1, desc_act):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(bits))         # HF [out, in]
    parts, want = gptq_quantize(w, bits, group=32, desc_act=desc_act, v1=v1, seed=1)
    fmt = gptq_format({"quant_method": "gptq", "bits": bits, "group_size": 32,
                       "checkpoint_format": "gptq" if v1 else "gptq_v2"}, "config.json")
    got = dequantize_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"], fmt)
    assert got.dtype == torch.float16 and torch.equal(got.T, want)
    assert (want != 0).float().mean() > 0.3 if bits > 2 else want.abs().max() > 0
    per = 32 // bits                             # a block whose rows and columns start inside an int32
    (r0, r1), (c0, c1) = (per + 1, 80), (3 if per > 1 else 0, 45)
    block = dequantize_gptq(parts["qweight"][r0 // per:-(-r1 // per), c0:c1], parts["qzeros"][:, c0 // per:-(-c1 // per)],
                            parts["scales"][:, c0:c1], parts["g_idx"][r0:r1], fmt, r0 % per, c0 % per)
    assert torch.equal(block, want.T[r0:r1, c0:c1])


def test_v1_zero_points_are_stored_minus_one():
    """The same codes read under v1 and v2 differ by exactly one zero point (one scale)."""
    codes = torch.arange(8 * 8).reshape(8, 8) % 16
    zeros = torch.full((1, 8), 5)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    qw, qz, g = gptq_pack(codes, 4, 0), gptq_pack(zeros, 4, 1), torch.zeros(8, dtype=torch.int32)
    v1 = dequantize_gptq(qw, qz, scales, g, gptq_format({"quant_method": "gptq", "bits": 4}, "c"))
    v2 = dequantize_gptq(qw, qz, scales, g, gptq_format({"quant_method": "gptq", "bits": 4,
                                                         "checkpoint_format": "gptq_v2"}, "c"))
    assert torch.equal(v2.float(), 0.5 * (codes - 5).float()) and torch.equal(v1.float(), v2.float() - 0.5)


def _write(tmp, bits=4, group=32, desc_act=True, v1=True, conf_kw=None, g_idx=True):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**KW)).float().eval()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors, deq, qc = gptq_serialized(sd, bits, group, desc_act, v1)
    if not g_idx:                                # (older checkpoints: row i in group i // group_size)
        tensors = {k: v for k, v in tensors.items() if not k.endswith(".g_idx")}
    d = tmp / f"gptq{bits}"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    conf = model.config.to_dict()
    conf["quantization_config"] = {**qc, **(conf_kw or {})}
    (d / "config.json").write_text(json.dumps(conf))
    model.load_state_dict({k: v.float() for k, v in deq.items()})
    return d, model, deq


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("gptq"))


def test_tiny_llama_reads_the_dequantized_weights_and_equals_transformers(gptq_dir):
    d, model, deq = gptq_dir
    cfg, params = hf.load_hf_llama(d, dtype=torch.float32)
    flat = dict(tree.leaves_with_paths(params))
    assert torch.equal(flat["layers.0.mlp.down_proj"], deq["model.layers.0.mlp.down_proj.weight"].float().T)
    with torch.no_grad():
        want = model(input_ids=tokens()).logits
    torch.testing.assert_close(our_logits(params, cfg, tokens()), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [16, -1])
def test_a_checkpoint_without_g_idx_reads_rows_in_order_of_groups(tmp_path, group):
    d, _, deq = _write(tmp_path, bits=8, group=group, desc_act=False, v1=False, g_idx=False)
    _, params = hf.load_hf_llama(d, dtype=torch.float32)
    flat = dict(tree.leaves_with_paths(params))
    for p, k in (("layers.0.mlp.down_proj", "mlp.down_proj"), ("layers.0.self_attn.o_proj", "self_attn.o_proj")):
        assert torch.equal(flat[p], deq[f"model.layers.0.{k}.weight"].float().T.reshape(flat[p].shape)), p


def test_lora_step_on_the_gptq_base_equals_peft(gptq_dir):
    d, model, _ = gptq_dir
    assert_lora_step_equals_peft(model, d, TARGETS)


@pytest.mark.parametrize("change, message", [
    ({"bits": 3}, r"quantization_config.bits 3 is not read \(GPTQ bits \(2, 4, 8\)"),
    ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not read"),
    ({"quant_method": "awq"}, r"need quantization_config \{quant_method: gptq"),
    ({"group_size": 48}, r"are not a 4-bit GPTQ linear of group size 48"),
])
def test_bad_gptq_checkpoints_are_refused_by_name(tmp_path, change, message):
    d, _, _ = _write(tmp_path, conf_kw=change)       # (the tensors of 4 bits, groups of 32)
    with pytest.raises(hf.CheckpointError, match=message):
        hf.load_hf_llama(d)


SHARD_RULES = Rules(batch="dp_shard", hidden="dp_shard", heads="tp", kv_heads="tp", mlp="tp", vocab="tp")


def _shards(path: str) -> dict:
    """This device's parameters read from ``path`` under :data:`SHARD_RULES` with their regions."""
    from functional_pp.core.layout import block_slices
    from functional_pp.models import llama
    cfg = hf.config_from_hf(path)
    with fpp.use_rules(SHARD_RULES):
        local = hf.load_hf_params(path, cfg, dtype=torch.float32)
    mesh, rank = fpp.current_mesh(), fpp.current_rank()
    return {p: (x, block_slices(tuple(d.shape), SHARD_RULES.resolve(d.dims, tuple(d.shape), mesh, name=p), mesh, rank))
            for (p, x), (_, d) in zip(tree.leaves_with_paths(local), tree.leaves_with_paths(llama.init(cfg)))}


@pytest.mark.multiprocess
def test_fsdp_x_tp_gloo_processes_read_their_blocks_of_the_gptq_weights(tmp_path):
    """FSDP x TP (2 x 2) on four gloo processes: each reads only its int32s, zero points and scales,
    and its blocks equal the one device's weights. hidden 96 and 2-bit codes (16 to an int32): the
    FSDP halves of hidden (48 rows) start inside an int32 of qweight, tp's halves of the output
    columns inside one of qzeros."""
    global KW
    saved, KW = KW, {**KW, "hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2}
    try:
        d, _, _ = _write(tmp_path, bits=2, group=32)
    finally:
        KW = saved
    _, whole = hf.load_hf_llama(d, dtype=torch.float32)
    flat, split = dict(tree.leaves_with_paths(whole)), set()
    for shards in fpp.launch(functools.partial(_shards, str(d)), fpp.Mesh(dp_shard=2, tp=2), processes=True,
                             timeout=300):
        for p, (x, region) in shards.items():
            assert torch.equal(x, flat[p][region]), p
            split.update([p] if x.shape != flat[p].shape else [])
    assert {"layers.0.mlp.gate_proj", "layers.0.mlp.down_proj", "layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj"} <= split


def test_lora_run_on_a_gptq_base_exports_the_adapter_and_the_merged_dequantized_weights(gptq_dir, tmp_path):
    """``gptq: true`` with LoRA on q/k/v/o (Axolotl's llama-2/gptq-lora.yml), FSDP x TP on 4 simulated
    devices, one step at learning rate 1e-12: the PEFT export holds the adapters of the targets, the
    merged export (an unquantized HF directory) the checkpoint's dequantized weights."""
    from safetensors.torch import load_file

    from functional_pp import cli
    d, _, deq = gptq_dir
    config = tmp_path / "gptq.yaml"
    config.write_text(f"base_model: {d}\ngptq: true\ngptq_disable_exllama: true\nadapter: lora\n"
                      f"lora_target_modules: [{', '.join(TARGETS)}]\nlora_r: 4\nlora_alpha: 8\ndp_shard_size: 2\n"
                      "tp_size: 2\nsequence_len: 16\nmicro_batch_size: 1\ngradient_accumulation_steps: 1\nmax_steps: 1\n"
                      "save_steps: 1\nlearning_rate: 1.0e-12\nlr_scheduler: constant\nwarmup_steps: 0\n"
                      "data: {path: null, max_bytes: 4000}\nlogging: {log_every: 1, plot: false}\n")
    out = tmp_path / "run"
    assert cli.main(["train", str(config), "--simulate", "4", "--output", str(out)]) == 0
    assert cli.main(["export", str(out), str(tmp_path / "adapter")]) == 0
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * len(TARGETS) and all("lora_" in k for k in adapter)
    assert cli.main(["export", str(out), str(tmp_path / "merged"), "--merge-adapter"]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    assert not any(k.endswith(("qweight", "qzeros", "scales", "g_idx")) for k in merged)
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        torch.testing.assert_close(merged[k].float(), deq[k].float(), rtol=0, atol=1e-6)


def test_gptq_config_keys_are_checked_before_any_work(tmp_path):
    from functional_pp.config import ConfigError, TrainConfig
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "awq"}}))
    lora = {"adapter": "lora", "lora_target_linear": True}
    for raw, message in [({"base_model": str(tmp_path), **lora}, r"has no GPTQ quantization_config \(quant_method: gptq; "
                                                                 r"found 'awq'\)"),
                         ({}, r"gptq: true with adapter: None: the GPTQ base is frozen"),
                         ({"load_in_8bit": True, **lora}, r"gptq: true with load_in_8bit: a GPTQ base is read dequantized"),
                         ({"gptq_groupsize": 128, **lora}, r"'gptq_groupsize' is not supported: the GPTQ format")]:
        with pytest.raises(ConfigError, match=message):
            TrainConfig.from_dict({"gptq": True, **raw})
    assert any(n.startswith("gptq_disable_exllama") for n in
               TrainConfig.from_dict({"gptq": True, "gptq_disable_exllama": True, **lora}).notes)
