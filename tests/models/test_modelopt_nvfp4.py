"""ModelOpt NVFP4 checkpoints (NVIDIA's ``...-NVFP4`` repositories: each linear's ``weight`` uint8
E2M1 pairs, ``weight_scale`` float8_e4m3fn per 16 inputs, ``weight_scale_2`` per tensor,
``input_scale``) read dequantized by the Hugging Face import (checkpoint/hf.py, quant/fp4.py),
bit for bit as torchao's ``NVFP4Tensor.dequantize`` of the same codes and scales; each device
reads its shard (FSDP x TP simulated, and gloo processes)."""
import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core.layout import block_slices
from functional_pp.core.tree import leaves_with_paths
from functional_pp.models import llama
from functional_pp.quant import fp4

transformers = pytest.importorskip("transformers")
nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

CONFIG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=64)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``(ModelOpt NVFP4 checkpoint, the same weights dequantized by torchao as a bf16-free fp32
    checkpoint)`` of a tiny Llama made by transformers."""
    torch.manual_seed(0)
    plain = tmp_path_factory.mktemp("plain")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(plain)
    sd = load_file(plain / "model.safetensors")
    quantized, dense = dict(sd), dict(sd)
    for k in [k for k in sd if k.endswith(tuple(f"{n}.weight" for n in LINEARS))]:
        w = sd[k].to(torch.bfloat16)
        t = nvfp4.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=nvfp4.per_tensor_amax_to_scale(w.abs().max().float()))
        pre = k.removesuffix(".weight")
        quantized.update({k: t.qdata.view(torch.uint8).contiguous(), f"{k}_scale": t.scale.contiguous(),
                          f"{k}_scale_2": t.per_tensor_scale.reshape(()).float(),
                          f"{pre}.input_scale": torch.tensor(0.01)})
        dense[k] = t.dequantize(torch.float32)
    out = {}
    for name, tensors in (("nvfp4", quantized), ("dense", dense)):
        d = out[name] = tmp_path_factory.mktemp(name)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        conf = json.loads((plain / "config.json").read_text())
        if name == "nvfp4":
            conf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
        (d / "config.json").write_text(json.dumps(conf))
    return out["nvfp4"], out["dense"]


def test_dequantization_equals_torchao_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 8, 64, generator=g) * 3).to(dtype)
        t = nvfp4.NVFP4Tensor.to_nvfp4(x.reshape(24, 64), per_tensor_scale=nvfp4.per_tensor_amax_to_scale(
            x.abs().max().float()))
        got = fp4.dequantize_nvfp4(t.qdata.view(torch.uint8), t.scale, t.per_tensor_scale)
        assert torch.equal(got, t.dequantize(torch.float32)), dtype
    with pytest.raises(ValueError, match="block scales float8_e4m3fn"):
        fp4.dequantize_nvfp4(t.qdata.view(torch.uint8), t.scale[:, :2], t.per_tensor_scale)


def test_a_modelopt_checkpoint_loads_as_torchao_dequantizes_it(dirs):
    (cfg_q, got), (cfg_d, want) = hf.load_hf_llama(dirs[0]), hf.load_hf_llama(dirs[1])
    assert cfg_q == cfg_d
    flat = dict(leaves_with_paths(want))
    for p, x in leaves_with_paths(got):
        assert x.dtype == flat[p].dtype and torch.equal(x, flat[p]), p
    assert float(dict(leaves_with_paths(got))["layers.1.mlp.down_proj"].abs().max()) > 0.01


def _shards(path: str, rules) -> dict:
    cfg = hf.config_from_hf(path)
    with fpp.use_rules(rules):
        local = hf.load_hf_params(path, cfg)
    decls, mesh, rank = llama.init(cfg), fpp.current_mesh(), fpp.current_rank()
    return {p: (x, block_slices(tuple(d.shape), rules.resolve(d.dims, tuple(d.shape), mesh, name=p), mesh, rank))
            for (p, x), (_, d) in zip(leaves_with_paths(local), leaves_with_paths(decls))}


@pytest.mark.parametrize("processes", [False, True])
def test_each_device_reads_its_shard(dirs, processes):
    _, whole = hf.load_hf_llama(dirs[1])
    flat, split = dict(leaves_with_paths(whole)), set()
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()
    for shards in fpp.launch(functools.partial(_shards, str(dirs[0]), rules), mesh, processes=processes, timeout=300):
        for p, (x, region) in shards.items():
            assert torch.equal(x, flat[p][region]), p
            split.add(p) if x.shape != flat[p].shape else None
    assert {"layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"} <= split


def test_a_partial_nvfp4_weight_is_refused_by_name(dirs, tmp_path):
    sd = load_file(dirs[0] / "model.safetensors")
    del sd["model.layers.0.self_attn.q_proj.weight_scale"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((dirs[0] / "config.json").read_text())
    with pytest.raises(Exception, match=r"q_proj\.weight_scale_2 without .*q_proj\.weight and .*weight_scale"):
        hf.load_hf_llama(tmp_path)
