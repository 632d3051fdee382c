"""MPT (``model_type: mpt``, Replit code): ALiBi attention (``ops.attention``'s ``alibi_max``), bias-free
LayerNorms, q/k/v fused in ``Wqkv``, a GELU MLP; against tiny random ``MptForCausalLM`` models built by
transformers (heads a power of two and not): logits, fp64 loss and every gradient, export, LoRA = peft,
FSDP x TP + SP and CP = one device (simulated and gloo processes), the refusals."""
from __future__ import annotations

import pytest
import torch
from harness import (assert_export_round_trip, assert_hf_layout_equals_one_device, assert_processes_equal_one_device,
                     fp64_beside_hf, import_logits_beside_hf, make_batch, our_logits)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.ops.attention import alibi_slopes

transformers = pytest.importorskip("transformers")
EAGER = dict(attn_implementation="eager")


@pytest.fixture(scope="module", params=[4, 6], ids=["heads4", "heads6"])
def saved(request, tmp_path_factory):
    heads = request.param
    torch.manual_seed(0)
    conf = transformers.MptConfig(vocab_size=256, d_model=16 * heads, n_layers=2, n_heads=heads, max_seq_len=128,
                                  bos_token_id=None, eos_token_id=None)
    model = transformers.MptForCausalLM(conf).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp(f"mpt{heads}")
    model.save_pretrained(d, safe_serialization=True)
    return model, d


def test_slopes_are_mpts_table(saved):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor
    heads = saved[0].config.n_heads
    table = build_mpt_alibi_tensor(heads, 5, 8)          # (heads, 1, 5): slope * (j - 4)
    torch.testing.assert_close(alibi_slopes(heads, 8.0), -table[:, 0, 0] / 4)


def test_logits_equal_transformers_and_alibi_matters(saved):
    import dataclasses
    cfg, params, toks, want = import_logits_beside_hf(*saved)
    assert (cfg.alibi_max, cfg.norm_kind, cfg.norm_bias, cfg.mlp, cfg.tie_embeddings) == (
        8.0, "layer", False, 4 * cfg.hidden, True)
    assert not torch.allclose(our_logits(params, dataclasses.replace(cfg, alibi_max=4.0), toks), want, atol=1e-3)


def test_loss_and_gradients_equal_transformers(saved):
    model, cfg, loss, grads, out, want = fp64_beside_hf(saved[1])
    want.backward()
    # (transformers' ALiBi table is fp32 and slope * (j - last) rather than (j - i): equal after the softmax)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-8, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    files = dict(hf._file_tensors(llama.init(cfg), cfg))
    for name, p in model.named_parameters():
        parts = files[name]
        g = hf.fuse_rows([kind.to_hf(ours[q]) for q, kind, _ in parts], cfg, getattr(parts[0][1], "row_axis", 0))
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-6 * p.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "mpt", "MptForCausalLM")


def test_lora_equals_peft(saved):
    """peft's LoRA of transformers' ``out_proj``, ``up_proj`` and ``down_proj`` (ours ``o_proj``,
    ``up_proj``, ``down_proj``): one step's loss and every adapter gradient."""
    import peft
    import torch.nn.functional as F

    from functional_pp import adapters
    from functional_pp.adapters import peft_dir
    from harness import train_adapters
    model = transformers.MptForCausalLM.from_pretrained(saved[1], dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["out_proj", "up_proj",
                                                                                        "down_proj"]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn_like(p))
    cfg = hf.config_from_hf(saved[1])
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=("o_proj", "up_proj", "down_proj"))
    decls = adapters.init(llama.init(cfg), lc)
    state = {k.replace(".default", ""): v.detach().clone() for k, v in pm.state_dict().items() if "lora_" in k}
    full = adapters.joined(hf.load_hf_params(saved[1], cfg), peft_dir.from_peft(state, decls, cfg.model_type))
    batch = make_batch(cfg, batch=2, seq=12, seed=3)
    ours = train_adapters(cfg, lc, decls, full, [batch], fpp.Mesh(), fpp.Rules(), 1e-2, 0.1)[0]
    logits = pm(input_ids=batch["tokens"]).logits
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    ref.backward()
    torch.testing.assert_close(torch.tensor(float(ours[0][0])), ref.detach().reshape(()), rtol=1e-5, atol=1e-6)
    grads = peft_dir.to_peft(ours[1], cfg.model_type)
    want = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if p.requires_grad}
    assert grads.keys() == want.keys() and len(want) == 2 * 3 * cfg.layers
    for k in want:
        assert want[k].abs().max() > 0, k
        torch.testing.assert_close(grads[k], want[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {k}: {m}")


@pytest.mark.parametrize("layout", ["fsdp_tp_sp", "cp"])
def test_layouts_equal_one_device(saved, layout):
    assert_hf_layout_equals_one_device(saved[1], layout)


def test_greedy_sampling_with_the_cache_equals_transformers_generate(saved):
    """The new tokens' ALiBi distances to the cached keys: greedy tokens equal transformers'
    ``generate``; the static cache (``compile``) is refused by name."""
    import functools

    from functional_pp.models import sampling
    from functional_pp.parallel import sharding
    model, d = saved
    cfg, params = hf.load_hf_llama(d)
    named = sharding.named_tree(params, llama.init(cfg))
    prompts = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    forward = functools.partial(llama.forward, cfg=cfg)
    ours = sampling.generate(forward, named, prompts, max_new_tokens=6)
    assert torch.equal(ours, model.generate(prompts, max_new_tokens=6, do_sample=False))
    with pytest.raises(ValueError, match=r"static key / value cache .* does not support ALiBi"):
        sampling.generate(forward, named, prompts, max_new_tokens=2, compile="aot_eager")


def test_config_reads_and_refuses_by_name():
    base = dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2, vocab_size=256)
    cfg = hf.config_from_hf(dict(base, attn_config={"attn_pdrop": 0.1, "alibi_bias_max": 16}))
    assert (cfg.attention_dropout, cfg.residual_dropout, cfg.alibi_max) == (0.1, 0.1, 16.0)
    for extra, msg in ((dict(attn_config={"alibi": False}), r"attn_config.alibi=False is not supported"),
                       (dict(attn_config={"qk_ln": True}), r"attn_config.qk_ln=True"),
                       (dict(no_bias=False), r"no_bias=False is not supported"),
                       (dict(expansion_ratio=2), r"expansion_ratio=2 is not supported")):
        with pytest.raises(ck.CheckpointMismatchError, match=rf"HF mpt config: {msg}"):
            hf.config_from_hf(dict(base, **extra))


def test_real_processes_equal_one_device():
    """Two AdamW steps of a tiny MPT on four gloo processes (FSDP x TP) equal one device's."""
    cfg = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=4, mlp=128, max_seq=32, model_type="mpt",
                       alibi_max=8.0, norm_kind="layer", mlp_gated=False, mlp_act="gelu", tie_embeddings=True)
    assert_processes_equal_one_device(cfg, rules=llama.default_rules(sequence_parallel=True))
