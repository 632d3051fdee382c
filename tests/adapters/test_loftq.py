"""LoftQ initialisation (``peft: {loftq_config: {loftq_bits: 4}}``, adapters/loftq.py) against peft's
``get_peft_model(model, LoraConfig(init_lora_weights="loftq", loftq_config=LoftQConfig(...)))`` on a
tiny transformers Llama: the base weights and adapters we start from equal peft's (fp32), and so do
the first loss; FSDP x TP (simulated) and FSDP on two gloo processes start from the same values and
train to the same losses as one device (docs/adapters.md "LoftQ").

peft's ``loftq_init`` quantizes on CUDA / XPU only: the oracle runs its own source with the
device line set to the CPU, and bitsandbytes' reference ``dequantize_4bit`` kernel (its native CPU
kernel is wrong where blocks of 64 cross rows of the weight: tests/models/test_quantize_any_shape.py).
"""
from __future__ import annotations

import functools
import inspect
import textwrap

import numpy as np
import pytest
import torch

import functional_pp as fpp
from functional_pp.adapters.loftq import loftq_matrix

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

HF = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, rms_norm_eps=1e-5, max_position_embeddings=64, pad_token_id=None,
          tie_word_embeddings=False)
R, ALPHA = 4, 8
_REFERENCE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
_DEVICE_LINE = 'compute_device = "xpu" if is_xpu_available() else "cuda"'


def _reference_dequantize_4bit(A, quant_state):
    return torch.ops.bitsandbytes.dequantize_4bit.default.redispatch(
        _REFERENCE, A, quant_state.absmax, quant_state.blocksize, quant_state.quant_type, quant_state.shape,
        quant_state.dtype)


def _peft_loftq_on_cpu():
    """peft's ``loftq_init``, its own source with the compute device set to the CPU."""
    from peft.utils import loftq_utils
    src = textwrap.dedent(inspect.getsource(loftq_utils.loftq_init))
    ns = dict(vars(loftq_utils))
    if _DEVICE_LINE in src:                                  # peft before 0.22
        src = src.replace(_DEVICE_LINE, 'compute_device = "cpu"')
    elif "compute_device = infer_device()" in src:           # peft 0.22: the accelerator it finds
        ns["infer_device"] = lambda: "cpu"
    else:
        raise AssertionError("peft's loftq_init changed: update the oracle")
    exec(src, ns)
    return ns["loftq_init"]


def _peft_model(model, bits: int):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(peft.tuners.lora.layer, "loftq_init", _peft_loftq_on_cpu())
        mp.setattr(bnb.functional, "dequantize_4bit", _reference_dequantize_4bit)
        conf = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", init_lora_weights="loftq",
                               loftq_config=peft.LoftQConfig(loftq_bits=bits))
        return peft.get_peft_model(model, conf).eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("loftq") / "base"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).float().save_pretrained(d)
    return d


def _batch():
    t = torch.randint(0, HF["vocab_size"], (4, 9), generator=torch.Generator().manual_seed(2))
    return {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


def _conf(base, bits: int, **sizes) -> dict:
    return {"adapter": "lora", "lora_r": R, "lora_alpha": ALPHA, "lora_target_linear": True,
            "peft": {"loftq_config": {"loftq_bits": bits}}, "base_model": str(base), "sequence_len": 8, **sizes}


def _device(conf: dict, steps: int = 2) -> tuple[dict, list[float]]:
    """The run's starting parameters (gathered whole, ours) and the losses of ``steps`` steps."""
    from functional_pp.app.inputs import frozen_and_adapters, loftq_params
    from functional_pp.config import TrainConfig, model_config, model_family
    from functional_pp.models import llama
    cfg = TrainConfig.from_dict(conf)
    n = conf.get("dp_shard_size", 1) * conf.get("tp_size", 1)
    cfg.validate(n)
    mesh = cfg.mesh(n)
    rules = cfg.build_rules(mesh)
    model_cfg = model_config(cfg)
    base_decls = model_family(cfg).param_decls(model_cfg)
    lora = cfg.lora_config()
    loss, decls, trainable = frozen_and_adapters(cfg, lora, functools.partial(llama.loss, cfg=model_cfg), base_decls)
    params = loftq_params(cfg, model_cfg, base_decls, decls, mesh, rules)
    with fpp.use_rules(rules):
        start = fpp.gather_tree(params, decls, rules)
        step = fpp.train_step(loss, fpp.optim.adamw(1e-2), mesh=mesh, rules=rules, trainable=trainable)
        state = step.init(params)
        batch = {k: fpp.named(v, "batch seq").data for k, v in _batch().items()}
    losses = []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return {p: x.data.numpy() for p, x in fpp.leaves_with_paths(start)}, losses


def _as_hf(ours: dict, cfg) -> dict[str, np.ndarray]:
    """Our starting tree in peft's names and shapes: weights ``[out, in]`` (embedding ``[vocab,
    hidden]``), ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``."""
    from functional_pp.models import llama
    from functional_pp.models.llama_hf import hf_name
    decls = dict(fpp.leaves_with_paths(llama.init(cfg)))
    adapted = {p.split(".lora.")[0] + "." + p.split(".lora.")[1].rsplit(".", 1)[0] for p in ours if ".lora." in p}
    out = {}
    for p, x in ours.items():
        if ".lora." in p:
            w, k = p.replace(".lora.", ".").rsplit(".", 1)
            name = hf_name(w).replace(".weight", f".{k}.default.weight")
            out["base_model.model." + name] = x.reshape(-1, R).T if k == "lora_A" else x.reshape(R, -1).T
            continue
        n = int(decls[p].meta.get("in_dims", 1))
        if x.ndim > 1 and p != "embed_tokens":
            x = x.reshape(int(np.prod(x.shape[:n])), -1).T
        name = hf_name(p).replace(".weight", ".base_layer.weight") if p in adapted else hf_name(p)
        out["base_model.model." + name] = x
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_loftq_start_and_first_loss_equal_peft(base, bits):
    from functional_pp.checkpoint import hf
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    theirs = {k: v.detach().numpy() for k, v in _peft_model(model, bits).state_dict().items()}
    ours, losses = fpp.launch(functools.partial(_device, _conf(base, bits), steps=1), fpp.Mesh())[0]
    mine = _as_hf(ours, hf.config_from_hf(base))
    assert mine.keys() == theirs.keys()
    assert sum(".lora_A." in k for k in mine) == 7
    for k, x in theirs.items():
        np.testing.assert_allclose(mine[k], x, rtol=1e-5, atol=1e-6, err_msg=k)
    with torch.no_grad():
        b = _batch()
        hf_loss = _peft_model(transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32), bits)(
            input_ids=b["tokens"]).logits.log_softmax(-1)
        ref = -hf_loss.gather(-1, b["labels"].unsqueeze(-1)).mean().item()
    assert losses[0] == pytest.approx(ref, rel=1e-5)
    q = mine["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    orig = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).model.layers[0].self_attn
    assert np.abs(q - orig.q_proj.weight.detach().numpy()).max() > 0          # the base was replaced


def test_loftq_matrix_is_the_svd_of_the_quantization_residual():
    """The factors are the rank-r truncated SVD of W - Q (the reconstruction error drops from the
    quantization's), and iterating (loftq_iter) lowers it further, as the LoftQ paper."""
    w = torch.randn(48, 40, generator=torch.Generator().manual_seed(0)) * 0.05
    q1, a1, b1 = loftq_matrix(w, 4, 8, 1)
    q5, a5, b5 = loftq_matrix(w, 4, 8, 5)
    assert a1.shape == (8, 40) and b1.shape == (48, 8)
    err_q, err_1, err_5 = (torch.linalg.norm(w - q1), torch.linalg.norm(w - q1 - b1 @ a1),
                           torch.linalg.norm(w - q5 - b5 @ a5))
    assert err_1 < err_q and err_5 < err_1
    s = torch.linalg.svdvals(w - q1)
    assert torch.linalg.norm(w - q1 - b1 @ a1) == pytest.approx(torch.linalg.norm(s[8:]).item(), rel=1e-4)


def test_loftq_under_fsdp_tp_and_on_gloo_processes_equals_one_device(base):
    one, one_losses = fpp.launch(functools.partial(_device, _conf(base, 4)), fpp.Mesh())[0]
    sizes = {"dp_shard_size": 2, "tp_size": 2}
    for start, losses in fpp.launch(functools.partial(_device, _conf(base, 4, **sizes)), fpp.Mesh(dp_shard=2, tp=2)):
        for p, x in one.items():
            np.testing.assert_array_equal(start[p], x, err_msg=p)
        np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    conf = _conf(base, 4, dp_shard_size=2)
    real = fpp.launch(functools.partial(_device, conf), fpp.Mesh(dp_shard=2), processes=True, timeout=300)
    sim = fpp.launch(functools.partial(_device, conf), fpp.Mesh(dp_shard=2))
    for (start, losses), (s_start, s_losses) in zip(real, sim):
        assert losses == s_losses and losses[1] < losses[0]
        for p, x in one.items():
            np.testing.assert_array_equal(start[p], x, err_msg=p)
            np.testing.assert_array_equal(s_start[p], x, err_msg=p)


@pytest.mark.parametrize("extra,message", [
    ({"peft": {"loftq_config": {"loftq_bits": 2}}}, "loftq_bits: 2: peft's LoftQ quantizes with 4 (NF4) or 8"),
    ({"load_in_4bit": True}, "LoftQ) with load_in_4bit"),
    ({"load_in_8bit": True}, "LoftQ) with load_in_8bit"),
    ({"adapter": "qlora"}, "initialises adapter: lora, not 'qlora'"),
    ({"peft_use_dora": True}, "LoftQ) with peft_use_dora"),
    ({"peft": {"loftq_config": {"loftq_bits": 4, "loftq_iter": 0}}}, "loftq_iter: 0"),
    ({"peft": {"loftq_config": {"bits": 4}}}, "peft.loftq_config: bits is not a LoftQ option"),
    ({"peft": {"use_dora": True}}, "peft: use_dora is not supported"),
])
def test_bad_loftq_settings_refused_by_name(base, extra, message):
    from functional_pp.config import ConfigError, TrainConfig
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig.from_dict({**_conf(base, 4), **extra}).validate(1)


def test_loftq_run_trains_and_exports_merged_only(tmp_path, capsys):
    """The train command with peft.loftq_config (a tiny Llama with a tokenizer, examples/
    make_tiny_hf_llama.py): it trains; its adapter directory is refused (the adapters belong to the
    LoftQ base, not base_model's), its merged export holds the LoftQ base plus the adapters."""
    import importlib.util
    import json
    from pathlib import Path

    from functional_pp import cli
    spec = importlib.util.spec_from_file_location(
        "make_tiny_hf_llama", Path(__file__).resolve().parents[2] / "examples" / "make_tiny_hf_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    inputs = mod.main(tmp_path / "inputs")
    conf = {**_conf(inputs / "tiny-llama", 4), "datasets": [{"path": str(inputs / "alpaca.jsonl"), "type": "alpaca"}],
            "sequence_len": 32, "micro_batch_size": 2, "max_steps": 2, "save_steps": 2,
            "output_dir": str(tmp_path / "run")}
    (tmp_path / "loftq.yaml").write_text(json.dumps(conf))
    assert cli.main(["train", str(tmp_path / "loftq.yaml"), "--simulate", "2"]) == 0
    assert "base:       LoftQ (peft.loftq_config): each adapted weight replaced by its 4-bit NF4" in capsys.readouterr().out
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "adapter")]) != 0
    assert not (tmp_path / "adapter" / "adapter_config.json").exists()
    assert cli.main(["export", "--merge-adapter", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    orig = transformers.LlamaForCausalLM.from_pretrained(inputs / "tiny-llama", dtype=torch.float32)
    w, w0 = merged.model.layers[0].mlp.up_proj.weight, orig.model.layers[0].mlp.up_proj.weight
    q = loftq_matrix(w0.detach(), 4, R)[0]                     # LoftQ's base: the NF4 round trip of W
    assert not torch.equal(w, w0) and torch.linalg.norm(w - w0) < torch.linalg.norm(q - w0) * 2
