"""Residual dropout (the attention's output after its output projection, the MLP's after its down
projection) and embedding dropout (the token embedding) read from StarCoder 2's
``residual_dropout`` / ``embedding_dropout``, Phi's, GPT-J's and GPT-2's ``resid_pdrop`` /
``embd_pdrop`` and GPT-NeoX's ``hidden_dropout`` (both sites), in training: masks hashed from global coordinates
(``models/dropout_seeds.py``). Oracles: transformers' model in training mode with the same masks in
place of torch's random ones; one device for the layouts."""
from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from harness import assert_processes_equal_one_device, make_batch, parallel

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import dropout_seeds, llama
from functional_pp.ops.keep_mask import keep_mask

transformers = pytest.importorskip("transformers")

P_ATTN, P_RES, P_EMB = 0.25, 0.125, 0.375
SIZES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=128)
GPT = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=128)
# family -> (its config, its rates: residual, embedding)
FAMILIES = {
    "starcoder2": (lambda: transformers.Starcoder2Config(
        **SIZES, num_key_value_heads=2, norm_epsilon=1e-5, use_bias=True, sliding_window=None,
        attention_dropout=P_ATTN, residual_dropout=P_RES, embedding_dropout=P_EMB), (P_RES, P_EMB)),
    "phi": (lambda: transformers.PhiConfig(**SIZES, partial_rotary_factor=0.5, attention_dropout=P_ATTN,
                                           resid_pdrop=P_RES, embd_pdrop=P_EMB), (P_RES, P_EMB)),
    "gpt_neox": (lambda: transformers.GPTNeoXConfig(**SIZES, rotary_pct=0.25, attention_dropout=P_ATTN,
                                                    hidden_dropout=P_RES), (P_RES, P_RES)),
    "phi3": (lambda: transformers.Phi3Config(**SIZES, num_key_value_heads=2, pad_token_id=None,
                                             attention_dropout=P_ATTN, resid_pdrop=P_RES), (P_RES, 0.0)),
    "gptj": (lambda: transformers.GPTJConfig(**GPT, rotary_dim=8, attn_pdrop=P_ATTN, resid_pdrop=P_RES,
                                             embd_pdrop=P_EMB), (P_RES, P_EMB)),
    "gpt2": (lambda: transformers.GPT2Config(**GPT, attn_pdrop=P_ATTN, resid_pdrop=P_RES, embd_pdrop=P_EMB),
             (P_RES, P_EMB)),
}


def _coords(*sizes: int) -> list[torch.Tensor]:
    """``arange`` of each size, shaped to broadcast along its own axis."""
    return [torch.arange(n).reshape([-1 if i == j else 1 for j in range(len(sizes))]) for i, n in enumerate(sizes)]


def _saved(tmp_path, family: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family][0]())
    with torch.no_grad():
        for n, w in model.named_parameters():
            w.copy_(1 + 0.1 * torch.randn_like(w) if "norm" in n and n.endswith("weight") else 0.1 * torch.randn_like(w))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


class _Hashed(torch.nn.Module):
    """An ``nn.Dropout`` of the model made the hashed one."""
    def __init__(self, fn, p: float):
        super().__init__()
        self.fn, self.p = fn, p

    def forward(self, x):
        return self.fn(x, self.p, self.training)


def _hashed_dropout(model, res: float, emb: float):
    """transformers' dropouts made ours (``nn.functional.dropout`` of the family's module and every
    ``nn.Dropout``): the probabilities (batch, heads, q, k), each branch output and the embedding
    (batch, seq, hidden; coordinates in name order batch, hidden, seq) masked by the hash of the
    first forward's seeds."""
    state = {"layer": None, "calls": 0}

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or not p:
            return x
        b, s, h = _coords(*x.shape[:3])
        if state["layer"] is None:                    # (before the first layer: the embedding)
            assert p == emb
            keep = keep_mask(dropout_seeds.site_seed(0, 0, dropout_seeds.EMBEDDING), [b, h, s], p)
        elif x.dim() == 4:
            assert p == P_ATTN
            base = dropout_seeds.site_seed(0, state["layer"], 0)
            keep = keep_mask(base + dropout_seeds.ATTENTION, _coords(*x.shape), p)
        else:
            assert p == res
            site = (dropout_seeds.ATTENTION_OUT, dropout_seeds.MLP_OUT)[state["calls"]]
            state["calls"] += 1
            keep = keep_mask(dropout_seeds.site_seed(0, state["layer"], 0) + site, [b, h, s], p)
        return x * keep.to(x.dtype) / (1 - p)

    def enter(i):
        def hook(*_):
            state.update(layer=i, calls=0)
        return hook
    base = model.base_model
    for i, layer in enumerate(base.layers if hasattr(base, "layers") else base.h):
        layer.register_forward_pre_hook(enter(i))
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Dropout) and module.p:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, _Hashed(dropout, module.p))
    functional = types.SimpleNamespace(softmax=torch.nn.functional.softmax, dropout=dropout)
    return types.SimpleNamespace(functional=functional)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_equals_transformers_with_the_same_masks(tmp_path, monkeypatch, family):
    import importlib
    d = _saved(tmp_path, family)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager")
    model.train()
    res, emb = FAMILIES[family][1]
    module = importlib.import_module(type(model).__module__)
    monkeypatch.setattr(module, "nn", _hashed_dropout(model, res, emb))
    cfg, params = hf.load_hf_llama(d, dtype=torch.float64)
    assert (cfg.attention_dropout, cfg.residual_dropout, cfg.embedding_dropout) == (P_ATTN, res, emb)
    batch = make_batch(cfg, batch=3, seq=12, seed=2)
    loss, grads, _ = parallel(cfg, params, batch, fpp.Mesh(), fpp.Rules())[0]   # (a fresh launch: forward 0)
    out = model(input_ids=batch["tokens"])
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab), batch["labels"].reshape(-1))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)    # (transformers' rotary tables: fp32)
    # (GPT-NeoX's module lm_head is embed_out in the files)
    hf_grads = {"embed_out.weight" if family == "gpt_neox" and n == "lm_head.weight" else n: w.grad
                for n, w in model.named_parameters()}
    ours = dict(tree.leaves_with_paths(grads))
    for name, parts in hf._file_tensors(llama.init(cfg), cfg):          # (fused: several of ours)
        g = hf.fuse_rows([kind.to_hf(ours[p]) for p, kind, _ in parts], cfg, getattr(parts[0][1], "row_axis", 0))
        torch.testing.assert_close(g, hf_grads[name], rtol=1e-5,
                                   atol=max(1e-6 * hf_grads[name].abs().max().item(), 1e-8),
                                   msg=lambda s: f"{name}: {s}")
    # each dropout matters: without it the loss differs
    for key in ("residual_dropout", "embedding_dropout") if emb else ("residual_dropout",):
        other = dataclasses.replace(cfg, **{key: 0.0})
        assert abs(parallel(other, params, batch, fpp.Mesh(), fpp.Rules())[0][0] - loss) > 1e-4, key


def test_starcoder2_exports_its_dropouts_and_checks_them(tmp_path):
    cfg, params = hf.load_hf_llama(_saved(tmp_path / "in", "starcoder2"), dtype=torch.float64)
    hf.save_hf_llama(params, cfg, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["residual_dropout"], written["embedding_dropout"]) == (P_RES, P_EMB)
    assert hf.config_from_hf(written) == cfg
    with pytest.raises(Exception, match=r"HF starcoder2 config: embedding_dropout=1.0 must be in \[0, 1\)"):
        hf.config_from_hf(dict(written, embedding_dropout=1.0))
    # Phi-3's resid_pdrop written back
    phi3, phi3_params = hf.load_hf_llama(_saved(tmp_path / "phi3", "phi3"), dtype=torch.float64)
    hf.save_hf_llama(phi3_params, phi3, tmp_path / "phi3_out")
    assert json.loads((tmp_path / "phi3_out" / "config.json").read_text())["resid_pdrop"] == P_RES
    # GPT-NeoX's one hidden_dropout holds both rates: two others refused on export by name
    neox, neox_params = hf.load_hf_llama(_saved(tmp_path / "neox", "gpt_neox"), dtype=torch.float64)
    hf.save_hf_llama(neox_params, neox, tmp_path / "neox_out")
    assert json.loads((tmp_path / "neox_out" / "config.json").read_text())["hidden_dropout"] == P_RES
    with pytest.raises(Exception, match=r"embedding_dropout"):
        hf.save_hf_llama(neox_params, dataclasses.replace(neox, embedding_dropout=0.0), tmp_path / "neox_bad")
    # a family that has no embedding dropout refuses to export one by name
    llama_cfg = dataclasses.replace(llama.Config(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, mlp=64),
                                    embedding_dropout=0.1)
    with pytest.raises(Exception, match=r"embedding_dropout"):
        hf.save_hf_llama(fpp.init_params(llama.init(llama_cfg), seed=0), llama_cfg, tmp_path / "llama")


CFG = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, max_seq=32, norm_kind="layer",
                   norm_bias=True, mlp_gated=False, mlp_act="gelu_tanh", qkv_bias=True, o_bias=True, mlp_bias=True,
                   attention_dropout=P_ATTN, residual_dropout=P_RES, embedding_dropout=P_EMB)


def test_fsdp_tp_simulated_equals_one_device():
    params = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    batch = make_batch(CFG, batch=4, seq=8)
    loss0, grads0, _ = parallel(CFG, params, batch, fpp.Mesh(), fpp.Rules())[0]
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True)
    for rank, (loss, grads, _) in enumerate(parallel(CFG, params, batch, mesh, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


def test_real_processes_equal_one_device():
    """Two AdamW steps on four gloo processes (FSDP x TP) equal one device's, every dropout on."""
    assert_processes_equal_one_device(CFG)


def test_config_refuses_embedding_dropout_with_compile_before_any_work(tmp_path):
    from functional_pp.config import ConfigError, TrainConfig
    from functional_pp.config.models import model_config
    d = _saved(tmp_path, "starcoder2")
    with pytest.raises(ConfigError, match=r"config.json's attention_dropout=0.25, residual_dropout=0.125, "
                                          r"embedding_dropout=0.375 with torch_compile is not supported"):
        model_config(TrainConfig.from_dict({"base_model": str(d), "torch_compile": True}))
    off = {k: 0.0 for k in ("attention_dropout", "residual_dropout", "embedding_dropout")}
    fine = TrainConfig.from_dict({"base_model": str(d), "torch_compile": True, "overrides_of_model_config": off})
    assert model_config(fine).embedding_dropout == 0.0
