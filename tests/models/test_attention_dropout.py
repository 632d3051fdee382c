"""Attention-probability dropout (``attention_dropout``) and Seed-OSS's ``residual_dropout``: masks
hashed from global coordinates (``ops.keep_mask.keep_mask``), so every layout drops what one device
drops. Oracles: an explicit fp64 reference of the op; transformers' ``SeedOssForCausalLM`` in
training mode with the same masks in place of torch's random ones; one device for the layouts."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from harness import assert_processes_equal_one_device, launch_steps, make_batch, parallel

import functional_pp as fpp
from functional_pp import ops
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import dropout_seeds, llama
from functional_pp.ops.keep_mask import keep_mask

transformers = pytest.importorskip("transformers")

CFG = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, max_seq=32, qkv_bias=True,
                   attention_dropout=0.25, residual_dropout=0.125)


def _coords(*sizes: int) -> list[torch.Tensor]:
    """``arange`` of each size, shaped to broadcast along its own axis."""
    return [torch.arange(n).reshape([-1 if i == j else 1 for j in range(len(sizes))]) for i, n in enumerate(sizes)]


def _qkv(B=3, S=8, H=4, K=2, D=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (H, K, K)]


def _op(q, k, v, **kw):
    attend = dict(batch="batch", seq="seq", heads="heads", kv_heads="kv_heads", head_dim="head_dim")
    out = ops.attention(fpp.wrap(q, "batch seq heads head_dim"), fpp.wrap(k, "batch seq kv_heads head_dim"),
                        fpp.wrap(v, "batch seq kv_heads head_dim"), **attend, **kw)
    return out.value()


def test_probabilities_dropped_as_the_explicit_reference():
    q, k, v = _qkv()
    B, S, H, D = q.shape
    p, seed = 0.3, 11
    got = _op(q, k, v, dropout=p, dropout_seed=seed)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(2, 1), vt.repeat_interleave(2, 1)
    scores = (qt @ kt.transpose(-1, -2)) / D ** 0.5
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    keep = keep_mask(seed, _coords(B, H, S, S), p)
    want = ((torch.softmax(scores, -1) * keep / (1 - p)) @ vt).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the keep-rate is 1 - p; p = 0 is today's path bit for bit; another seed other masks
    rate = keep_mask(3, _coords(4, 4, 64, 64), p).double().mean().item()
    assert abs(rate - (1 - p)) < 0.01, rate
    assert torch.equal(_op(q, k, v, dropout=0.0, dropout_seed=seed), _op(q, k, v))
    assert not torch.allclose(got, _op(q, k, v, dropout=p, dropout_seed=seed + 1))
    with pytest.raises(ValueError, match=r"attention: dropout: rate must be in \[0, 1\) \(a number\), got 1.0"):
        _op(q, k, v, dropout=1.0)


def _seed_oss_dir(tmp_path):
    torch.manual_seed(0)
    conf = transformers.SeedOssConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, intermediate_size=128, rms_norm_eps=1e-5,
                                      max_position_embeddings=128, attention_bias=True, attention_out_bias=True,
                                      attention_dropout=0.25, residual_dropout=0.125, pad_token_id=None)
    model = transformers.SeedOssForCausalLM(conf)
    with torch.no_grad():
        for n, w in model.named_parameters():
            w.copy_(1 + 0.1 * torch.randn_like(w) if "norm" in n else 0.1 * torch.randn_like(w))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _hashed_dropout(model, p_attn: float, p_res: float):
    """transformers' ``nn.functional.dropout`` in Seed-OSS's module made ours: the probabilities
    (batch, heads, q, k) and each branch output (batch, seq, hidden; coordinates in name order
    batch, hidden, res_seq) masked by the hash of the layer's seed of the first forward."""
    state = {"layer": None, "calls": 0}

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or not p:
            return x
        base = dropout_seeds.site_seed(0, state["layer"], 0)
        if x.dim() == 4:
            assert p == p_attn
            keep = keep_mask(base + dropout_seeds.ATTENTION, _coords(*x.shape), p)
        else:
            assert p == p_res
            site = (dropout_seeds.ATTENTION_OUT, dropout_seeds.MLP_OUT)[state["calls"]]
            state["calls"] += 1
            b, s, h = _coords(*x.shape)
            keep = keep_mask(base + site, [b, h, s], p)
        return x * keep.to(x.dtype) / (1 - p)

    def enter(i):
        def hook(*_):
            state.update(layer=i, calls=0)
        return hook
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(enter(i))
    functional = types.SimpleNamespace(**{n: getattr(torch.nn.functional, n) for n in ("softmax",)}, dropout=dropout)
    return types.SimpleNamespace(functional=functional)


def test_seed_oss_training_equals_transformers_with_the_same_masks(tmp_path, monkeypatch):
    from transformers.models.seed_oss import modeling_seed_oss as m
    d = _seed_oss_dir(tmp_path)
    model = transformers.SeedOssForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager")
    model.train()
    monkeypatch.setattr(m, "nn", _hashed_dropout(model, 0.25, 0.125))
    cfg, params = hf.load_hf_llama(d, dtype=torch.float64)
    assert (cfg.attention_dropout, cfg.residual_dropout) == (0.25, 0.125)
    batch = make_batch(cfg, batch=3, seq=12, seed=2)
    loss, grads, _ = parallel(cfg, params, batch, fpp.Mesh(), fpp.Rules())[0]   # (a fresh launch: forward 0)
    out = model(input_ids=batch["tokens"])
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab), batch["labels"].reshape(-1))
    want.backward()
    # (transformers computes the rotary tables in fp32)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    files = dict(hf._file_tensors(llama.init(cfg), cfg))
    for name, w in model.named_parameters():
        (path, kind, _), = files[name]
        torch.testing.assert_close(kind.to_hf(ours[path]), w.grad, rtol=1e-5, atol=1e-6 * w.grad.abs().max().item(),
                                   msg=lambda s: f"{name}: {s}")
    # the dropout matters: without it the loss differs
    plain = dataclasses.replace(cfg, attention_dropout=0.0, residual_dropout=0.0)
    assert abs(parallel(plain, params, batch, fpp.Mesh(), fpp.Rules())[0][0] - loss) > 1e-4


LAYOUTS = {
    "fsdp_tp_sp": (fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True)),
    "cp_balanced": (fpp.Mesh(cp=2), llama.default_rules(tp=False)),
    "dp_cp_tp": (fpp.Mesh(dp_shard=2, cp=2, tp=2), llama.default_rules()),
}


@pytest.mark.parametrize("layout", [*LAYOUTS, "cp_packed"])
def test_layouts_equal_one_device(layout):
    mesh, rules = LAYOUTS["cp_balanced" if layout == "cp_packed" else layout]
    params = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    batch = make_batch(CFG, batch=4, seq=8)
    if layout == "cp_packed":                      # packed documents: the segments' path
        batch["segments"] = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]] * 4)
    loss0, grads0, _ = parallel(CFG, params, batch, fpp.Mesh(), fpp.Rules())[0]
    for rank, (loss, grads, _) in enumerate(parallel(CFG, params, batch, mesh, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


def test_off_in_evaluation_and_generation():
    params = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    plain = dataclasses.replace(CFG, attention_dropout=0.0, residual_dropout=0.0)
    toks = make_batch(CFG, batch=2, seq=8)["tokens"]

    def logits(cfg):
        with torch.no_grad():
            return llama.forward(_named(params, cfg), fpp.wrap(toks, "batch seq"), cfg).value()
    assert torch.equal(logits(CFG), logits(plain))
    assert dropout_seeds.forward_seed(0.1, 0.1, cached=True) is None
    from functional_pp.models import sampling
    import functools
    gen = [sampling.generate(functools.partial(llama.forward, cfg=c), _named(params, c), toks[:, :4],
                             max_new_tokens=3) for c in (CFG, plain)]
    assert torch.equal(gen[0], gen[1])


def _named(params, cfg):
    from functional_pp.parallel import sharding
    return sharding.named_tree(params, llama.init(cfg, torch.float64))


def test_compiled_step_refuses_dropout_by_name():
    from functional_pp.devices.launch import DeviceError
    try:
        with pytest.raises(DeviceError, match=r"ValueError: dropout \(attention_dropout=0.25, residual_dropout=0.125\) "
                                              r"under a compiled step is not supported .*compile: false"):
            launch_steps(CFG, "aot_eager", batch=2, steps=1)
    finally:
        torch._dynamo.reset()


def test_real_processes_equal_one_device():
    """Two AdamW steps on four gloo processes (FSDP x TP) equal one device's, dropout on."""
    assert_processes_equal_one_device(CFG)


@pytest.mark.parametrize("key", ["torch_compile", "pp_size"])
def test_config_refuses_dropout_with_compile_or_pipeline_before_any_work(tmp_path, key):
    from functional_pp.config import ConfigError, TrainConfig
    from functional_pp.config.models import model_config
    d = _seed_oss_dir(tmp_path)
    cfg = TrainConfig.from_dict({"base_model": str(d), key: True if key == "torch_compile" else 2})
    with pytest.raises(ConfigError, match=rf"config.json's attention_dropout=0.25, residual_dropout=0.125 with {key} "
                                          r"is not supported .*overrides_of_model_config: \{attention_dropout: 0.0, "
                                          r"residual_dropout: 0.0\}"):
        model_config(cfg)
    fine = TrainConfig.from_dict({"base_model": str(d), key: True if key == "torch_compile" else 2,
                                  "overrides_of_model_config": {"attention_dropout": 0.0, "residual_dropout": 0.0}})
    assert model_config(fine).attention_dropout == 0.0


def test_a_named_step_fixes_the_seeds_whatever_ran_before():
    """The training loop names each step (``dropout_seeds.begin_step``): a resumed run, whose process
    ran no earlier forward, draws the masks of the uninterrupted one."""
    def seeds(warmup: int):
        def device():
            for _ in range(warmup):             # forwards of earlier steps (the uninterrupted run)
                dropout_seeds.forward_seed(0.1, 0.0, cached=False)
            dropout_seeds.begin_step(7)
            return [dropout_seeds.forward_seed(0.1, 0.0, cached=False) for _ in range(2)]
        return fpp.launch(device, fpp.Mesh())[0]
    assert seeds(0) == seeds(5) == [7 << 16, (7 << 16) + 1]


def test_training_run_with_dropout_resumes_bit_exactly(tmp_path):
    """A run of a model with dropout stopped after step 1 and resumed ends with the losses and
    parameters of the uninterrupted run (its masks follow the step, not the process's forwards);
    without the dropout the losses differ."""
    import io

    from functional_pp.app.loop import train
    from functional_pp.app.metrics import read_metrics
    from functional_pp.config import TrainConfig

    def config(out, **model):
        return TrainConfig.from_dict({"dp_shard_size": 2, "micro_batch_size": 2, "sequence_len": 16, "max_steps": 3,
                                      "learning_rate": 3e-3, "data": {"max_bytes": 20_000},
                                      "model": {"preset": "tiny", "layers": 1, **model},
                                      "logging": {"log_every": 1, "output_dir": str(out)}}, name="t")
    drop = dict(attention_dropout=0.3, residual_dropout=0.2)
    full, split, plain = tmp_path / "full", tmp_path / "split", tmp_path / "plain"
    train(config(full, **drop), stream=io.StringIO())
    train(config(split, **drop), stop_after=1, stream=io.StringIO())
    assert train(config(split, **drop), resume=True, stream=io.StringIO()).start_step == 1
    train(config(plain), stream=io.StringIO())
    loss = [[m["loss"] for m in read_metrics(out / "metrics.jsonl") if "loss" in m] for out in (full, split, plain)]
    assert len(loss[0]) == 3 and loss[0] == loss[1] and loss[0] != loss[2]
