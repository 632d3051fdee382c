"""gpt-oss checkpoints as the hub stores them: the experts' weights in MXFP4 (``*_blocks`` uint8 +
``*_scales`` E8M0, transformers' ``integrations/mxfp4.py``), read dequantized by the Hugging Face
import (checkpoint/hf.py, quant/fp4.py), bit for bit as transformers' ``convert_moe_packed_tensors``
and ``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``; each device reads
only its shard's blocks (simulated and on real gloo processes); Axolotl's
``model_quantization_config: Mxfp4Config`` with ``dequantize: true`` is accepted, anything else
refused by name."""
import functools
import json

import pytest
import torch
from harness import our_logits, tokens
from safetensors.torch import load_file, save_file

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.core.layout import Rules, block_slices
from functional_pp.core.tree import leaves_with_paths
from functional_pp.models import llama
from functional_pp.quant import fp4

transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
              max_position_embeddings=128, pad_token_id=None, eos_token_id=None, bos_token_id=None)
# experts over dp_shard, and down's input features (32) over tp: a shard starts inside a group of 32
RULES = Rules(batch="dp_shard", experts="dp_shard", mlp="tp", heads="tp", kv_heads="tp", vocab="tp")


@pytest.fixture(scope="module")
def mx_dir(tmp_path_factory):
    """A tiny gpt-oss written as the hub's: experts' weights as MXFP4 blocks and scales (random
    codes, scales around 2**-3), ``quantization_config`` in config.json."""
    torch.manual_seed(0)
    plain = tmp_path_factory.mktemp("plain")
    transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).float().save_pretrained(plain)
    sd = load_file(plain / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = sd.pop(k).shape
        sd[f"{k}_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g, dtype=torch.uint8)
        sd[f"{k}_scales"] = torch.randint(121, 127, (experts, outputs, inputs // 32), generator=g, dtype=torch.uint8)
    d = tmp_path_factory.mktemp("mxfp4")
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((plain / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(conf))
    return d


def test_dequantization_equals_transformers_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 5, 4), generator=g, dtype=torch.uint8)     # E8M0's whole finite range
    for dtype in (torch.float32, torch.bfloat16):
        want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        got = fp4.dequantize_mxfp4(blocks, scales).transpose(1, 2).to(dtype).contiguous()
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), dtype
    with pytest.raises(ValueError, match="blocks uint8"):
        fp4.dequantize_mxfp4(blocks, scales[..., :3])


def test_an_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(mx_dir):
    model = transformers.GptOssForCausalLM.from_pretrained(
        mx_dir, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    cfg, params = hf.load_hf_llama(mx_dir)
    for i, layer in enumerate(model.model.layers):
        mlp, theirs = params["layers"][i]["mlp"], layer.mlp.experts
        assert torch.equal(mlp["gate"], theirs.gate_up_proj[..., ::2])
        assert torch.equal(mlp["up"], theirs.gate_up_proj[..., 1::2])
        assert torch.equal(mlp["down"], theirs.down_proj)
    assert mlp["down"].abs().max() > 0.1
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)


def _shards(path: str) -> dict:
    """This device's parameters read from the checkpoint at ``path`` under :data:`RULES`, with their
    global regions."""
    cfg = hf.config_from_hf(path)
    with fpp.use_rules(RULES):
        local = hf.load_hf_params(path, cfg)
    decls, mesh, rank = llama.init(cfg), fpp.current_mesh(), fpp.current_rank()
    out = {}
    for (p, x), (_, d) in zip(leaves_with_paths(local), leaves_with_paths(decls)):
        shape = tuple(d.shape)
        out[p] = (x, block_slices(shape, RULES.resolve(d.dims, shape, mesh, name=p), mesh, rank))
    return out


def _check_shards(results: list, whole: dict) -> None:
    flat = dict(leaves_with_paths(whole))
    split = set()
    for shards in results:
        for p, (x, region) in shards.items():
            assert torch.equal(x, flat[p][region]), p
            if x.shape != flat[p].shape:
                split.add(p)
    assert "layers.0.mlp.down" in split and "layers.1.mlp.gate" in split


def test_each_device_reads_its_shard_of_the_mxfp4_experts(mx_dir):
    _, whole = hf.load_hf_llama(mx_dir)
    _check_shards(fpp.launch(functools.partial(_shards, str(mx_dir)), fpp.Mesh(dp_shard=2, tp=2)), whole)


@pytest.mark.multiprocess
def test_real_gloo_processes_read_their_shards(mx_dir):
    _, whole = hf.load_hf_llama(mx_dir)
    results = fpp.launch(functools.partial(_shards, str(mx_dir)), fpp.Mesh(dp_shard=2, tp=2), processes=True,
                         timeout=300)
    _check_shards(results, whole)


def _train(**keys) -> TrainConfig:
    return TrainConfig.from_dict({"base_model": "x", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], **keys})


def test_axolotl_keys_accept_mxfp4_dequantized_and_refuse_the_rest():
    ok = _train(model_quantization_config="Mxfp4Config", model_quantization_config_kwargs={"dequantize": True})
    assert ok.model_quantization_config == "Mxfp4Config"
    for keys, match in (({"model_quantization_config_kwargs": {"dequantize": False}}, "needs dequantize: true"),
                        ({"model_quantization_config_kwargs": None}, "needs dequantize: true"),
                        ({"model_quantization_config_kwargs": {"dequantize": True, "x": 1}}, "kwargs.x"),
                        ({"model_quantization_config": "GPTQConfig"}, "'model_quantization_config: GPTQConfig'")):
        with pytest.raises(ConfigError, match=match):
            _train(**{"model_quantization_config": "Mxfp4Config", **keys})


def test_the_start_up_summary_says_the_mxfp4_tensors_are_read_dequantized(tmp_path, capsys):
    import yaml
    from axolotl_corpus import tiny_model

    from functional_pp import cli
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Add {i} and {i}.", "input": "", "output": str(2 * i)}) + "\n"
                            for i in range(16)))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "base_model": str(tiny_model("gpt_oss", tmp_path / "models")), "datasets": [{"path": str(data), "type": "alpaca"}],
        "model_quantization_config": "Mxfp4Config", "model_quantization_config_kwargs": {"dequantize": True},
        "sequence_len": 64, "micro_batch_size": 1, "max_steps": 1, "output_dir": str(tmp_path / "out")}))
    assert cli.main(["validate", str(path), "--simulate", "2"]) == 0
    assert "base:       model_quantization_config: Mxfp4Config (dequantize: true): MXFP4 tensors" in capsys.readouterr().out


def test_export_writes_the_dequantized_experts_transformers_loads_unquantized(mx_dir, tmp_path):
    cfg, params = hf.load_hf_llama(mx_dir)
    hf.save_hf_llama(params, cfg, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in conf
    written = load_file(tmp_path / "model.safetensors")
    assert not any(k.endswith(("_blocks", "_scales")) for k in written)
    model = transformers.GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
