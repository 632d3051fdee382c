"""LFM2 (``model_type: lfm2``): short-convolution layers (models/short_conv.py) between attention
layers with q/k norms, against a tiny random ``Lfm2ForCausalLM`` built by transformers: logits,
fp64 loss and every gradient, export, LoRA = peft, FSDP x TP + SP and CP x TP (plain and packed rows)
= one device (simulated; FSDP x TP + SP also on gloo processes), and the refusals (sampling with a
cache, export as another class)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import (assert_cp_equals_one_device, assert_export_round_trip, assert_hf_layout_equals_one_device,
                     assert_packed_documents_equal_hf, assert_processes_equal_one_device, fp64_beside_hf,
                     import_logits_beside_hf, make_batch, our_logits, tokens)

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, layer_types=["conv", "full_attention", "conv"],
              block_multiple_of=32, pad_token_id=None, bos_token_id=None, eos_token_id=None)
EAGER = dict(attn_implementation="eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**CONFIG)).float().eval()
    with torch.no_grad():                    # O(1) logits, non-trivial norms
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("lfm2")
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = "eager"
    return model, d


def test_config_reads_layer_types_kernel_and_mlp(saved):
    cfg = hf.config_from_hf(saved[1])
    # (Lfm2MLP's width: 2/3 of intermediate_size, rounded up to block_multiple_of)
    assert (cfg.layer_types, cfg.conv_kernel, cfg.mlp, cfg.qk_norm, cfg.tie_embeddings) == (
        ("conv", "full_attention", "conv"), 3, 128, True, True)
    full = hf.config_from_hf(dict(CONFIG, model_type="lfm2", layer_types=None, full_attn_idxs=[1]))
    assert full.layer_types == ("conv", "full_attention", "conv")


def test_logits_equal_transformers_and_the_convolution_matters(saved):
    cfg, params, toks, want = import_logits_beside_hf(*saved)
    flipped = tree.map_with_path(lambda p, x: x.flip(-1) if p.endswith("conv.conv") else x, params)
    assert not torch.allclose(our_logits(flipped, cfg, toks), want, atol=1e-3)


def test_loss_and_gradients_equal_transformers(saved):
    model, cfg, loss, grads, out, want = fp64_beside_hf(saved[1], **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)   # (transformers' rotary tables in fp32)
    ours = dict(tree.leaves_with_paths(grads))
    files = dict(hf._file_tensors(llama.init(cfg), cfg))
    names = [n for n, _ in model.named_parameters()]
    assert {n for n in names if ".conv." in n} == {f"model.layers.{i}.conv.{k}.weight" for i in (0, 2)
                                                   for k in ("in_proj", "conv", "out_proj")}
    for name, p in model.named_parameters():
        (path, kind, _), = files[name]
        torch.testing.assert_close(kind.to_hf(ours[path]), p.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_export_round_trip_in_transformers(saved, tmp_path):
    assert_export_round_trip(saved[1], tmp_path / "out", "lfm2", "Lfm2ForCausalLM", **EAGER)


def test_lora_equals_peft(saved):
    """peft's LoRA of the convolution's projections, the attention's and the MLP's (transformers'
    names ``in_proj``, ``conv.out_proj``, ``q_proj``, ``w1`` are ours ``in_proj``, ``out_proj``,
    ``q_proj``, ``gate_proj``): one step's loss and every adapter gradient."""
    import peft
    import torch.nn.functional as F

    from functional_pp import adapters
    from functional_pp.adapters import peft_dir
    from harness import train_adapters
    model = transformers.Lfm2ForCausalLM.from_pretrained(saved[1], dtype=torch.float32, **EAGER)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*(in_proj|conv\.out_proj|q_proj|w1)"))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn_like(p))
    cfg = hf.config_from_hf(saved[1])
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=("in_proj", "out_proj", "q_proj", "gate_proj"))
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
    assert grads.keys() == want.keys() and len(want) == 2 * (2 * 2 + 1 + 3)      # (conv layers 0, 2; attention 1)
    for k in want:
        assert want[k].abs().max() > 0, k
        torch.testing.assert_close(grads[k], want[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {k}: {m}")


@pytest.mark.parametrize("layout", ["fsdp_tp_sp"])
def test_fsdp_tp_equals_one_device(saved, layout):
    assert_hf_layout_equals_one_device(saved[1], layout)


def test_context_parallelism_equals_one_device(saved):
    """The short convolutions under CP 2 x TP 2: each block's first positions read the last inputs of the
    block before (a halo handed on, ops/sequence_chain.py); packed rows read none of another document."""
    assert_cp_equals_one_device(saved[1])


def test_packed_documents_equal_transformers_on_each(saved):
    """Packed rows (``segments``): each document's logits equal transformers' logits of that document
    alone (no convolution tap reads the document before; attention stays inside)."""
    assert_packed_documents_equal_hf(*saved)


def test_cp_training_with_whole_layer_remat_equals_one_device():
    """Two AdamW steps under CP 2 with whole-layer activation checkpointing (the layer recomputed in
    backward, the chain's sends with it, in the same order on every device) equal one device's."""
    from harness import launch_steps
    cfg = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, max_seq=32, qk_norm=True,
                       layer_types=("conv", "full_attention"), tie_embeddings=True, model_type="lfm2")
    one = launch_steps(cfg, dtype=torch.float64)[0]
    for losses, params, _ in launch_steps(cfg, mesh=fpp.Mesh(cp=2), rules=llama.default_rules(tp=False),
                                          dtype=torch.float64, remat=True):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=1e-10, atol=0)
        for p, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one[1][p]), rtol=1e-8, atol=1e-12,
                                       msg=lambda m, p=p: f"{p}: {m}")


def test_refusals_name_the_conv_layers(saved):
    cfg, params = hf.load_hf_llama(saved[1], dtype=torch.float64)
    from functional_pp.models import sampling
    import functools
    from functional_pp.parallel import sharding
    named = sharding.named_tree(params, llama.init(cfg, torch.float64))
    with pytest.raises(ValueError, match=r"sampling with a key / value cache does not support LFM2's short-convolution"):
        sampling.generate(functools.partial(llama.forward, cfg=cfg), named, tokens(2, 4), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"export as 'qwen3': layer_types with 'conv' layers"):
        hf.check_exportable(dataclasses.replace(cfg, model_type="qwen3"))
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF lfm2 config: conv_bias=True is not supported"):
        hf.config_from_hf(dict(CONFIG, model_type="lfm2", conv_bias=True))


def test_real_processes_equal_one_device():
    """Two AdamW steps of a tiny LFM2 on four gloo processes (FSDP x TP) equal one device's."""
    cfg = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, max_seq=32, qk_norm=True,
                       layer_types=("conv", "full_attention"), tie_embeddings=True, model_type="lfm2")
    assert_processes_equal_one_device(cfg, rules=llama.default_rules(sequence_parallel=True))


def test_flops_count_the_convolution_layers_as_such():
    cfg = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, max_seq=32, qk_norm=True,
                       layer_types=("conv", "full_attention"))
    attention_only = dataclasses.replace(cfg, layer_types=None)
    conv = 2 * 32 * (4 * 32 + 3)                            # in_proj (3 gates), out_proj, the kernel
    attention = 2 * 32 * (4 * 8 + 2 * 2 * 8 + 4 * 8) + 2 * 16 * 4 * 8     # q, k, v, o; causal scores and values
    assert llama.flops_per_token(cfg, 16) - llama.flops_per_token(attention_only, 16) == 3 * (conv - attention)
