"""Mamba (v1) (``mamba``) as a configuration of the one decoder (models/mamba_hf.py, the mixer and
its selective scan in models/mamba1.py): a tiny random ``MambaForCausalLM`` transformers builds
from a config loads through the HF import (files under ``backbone.``, tied embeddings); logits,
the fp64 loss and every gradient equal transformers' (its scan's float32 casts kept in float64);
export writes ``MambaForCausalLM``, which loads with equal logits; FSDP x TP with sequence
parallelism on simulated devices, FSDP x TP on real gloo processes and a 1F1B pipeline equal one
device; CP 2 (load-balanced, the state handed between the devices; plain and packed rows, CP x TP) on
simulated devices and CP 2 on real gloo processes equal one device; packed documents each as alone;
the key / value cache and Jamba-only options refused by name."""
import pytest
import torch
from harness import (assert_1f1b_equals_one_device, assert_cp_equals_one_device, assert_export_round_trip,
                     assert_hf_layout_equals_one_device, assert_processes_equal_one_device, fp64_beside_hf,
                     hf_scan_in_fp64, import_logits_beside_hf, make_batch)

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MambaForCausalLM"):
    pytest.skip("transformers without Mamba", allow_module_level=True)

# two layers of 64 channels (split over tp 2), a state of 8, a time step of rank 6, 4 convolution taps
CONFIG = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, state_size=8, intermediate_size=64,
              time_step_rank=6, conv_kernel=4, pad_token_id=None, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(**CONFIG))
    with torch.no_grad():                       # D, the convolution's bias and the norms off their initial values
        for n, p in model.named_parameters():
            if n.endswith(("D", "conv1d.bias")) or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("mamba")
    model.save_pretrained(out)
    return out


def test_config_and_files_read(hf_dir):
    cfg = hf.config_from_hf(hf_dir)
    assert cfg.layer_blocks == ("mamba1", "mamba1") and cfg.tie_embeddings
    assert cfg.max_seq == 0                    # (no positions: sequence_len is not limited by them)
    m = cfg.mamba1
    assert (m.inner, m.state, m.dt_rank, m.conv_kernel, m.conv_bias, m.proj_bias, m.dt_norms) == (64, 8, 6, 4, True,
                                                                                                  False, False)
    auto = hf.config_from_hf({**CONFIG, "model_type": "mamba", "time_step_rank": "auto", "intermediate_size": None})
    assert (auto.mamba1_dt_rank, auto.mamba1_inner) == (2, 64)         # ceil(32 / 16), expand 2 x hidden
    cfg, params = hf.load_hf_llama(hf_dir)
    assert set(params["layers"][0]) == {"input_layernorm", "mamba1"} and "lm_head" not in params


def test_logits_equal_transformers(hf_dir):
    model = transformers.MambaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    import_logits_beside_hf(model, hf_dir)


@pytest.mark.parametrize("seq", [12, 70])
def test_fp64_loss_and_every_gradient_equal_transformers(hf_dir, tmp_path, seq):
    """(12 positions: chunks of 4; 70: chunks of 9, padded, whose 8 chunk ends are chunked again.)"""
    from safetensors.torch import load_file
    with hf_scan_in_fp64():
        model, cfg, loss, grads, out, want = fp64_beside_hf(hf_dir, "MambaForCausalLM", seq=seq)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    with hf_scan_in_fp64():
        want.backward()
    hf.save_hf_llama(grads, cfg, tmp_path / "grads")
    ours = load_file(str(tmp_path / "grads" / "model.safetensors"))
    theirs = {n: p.grad for n, p in model.named_parameters()}
    assert set(ours) == set(theirs)
    for name, g in ours.items():
        assert theirs[name].abs().max() > 0, name
        torch.testing.assert_close(g, theirs[name], rtol=1e-8, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")


def test_export_round_trip(hf_dir, tmp_path):
    assert_export_round_trip(hf_dir, tmp_path / "out", "mamba", "MambaForCausalLM")


def test_fsdp_tp_sp_equals_one_device(hf_dir):
    assert_hf_layout_equals_one_device(hf_dir, "fsdp_tp_sp")


def test_fsdp_tp_real_processes_equal_one_device(hf_dir):
    assert_processes_equal_one_device(hf.config_from_hf(hf_dir))


def test_cp_equals_one_device(hf_dir):
    """CP 2 (the scan's state and the convolution's last inputs handed from block to block, the
    balanced split's blocks in sequence order), alone and with TP 2, plain and packed rows whose
    documents cross the blocks' boundaries: the loss and every gradient equal one device's."""
    assert_hf_layout_equals_one_device(hf_dir, "cp")
    assert_cp_equals_one_device(hf_dir)
    assert_cp_equals_one_device(hf_dir, lengths=(6, 7, 11))   # (a document starting at a block's start: state reset)


def test_cp_real_processes_equal_one_device(hf_dir):
    """CP 2 on two gloo processes (the state permuted between them): two AdamW steps equal one device's."""
    assert_processes_equal_one_device(hf.config_from_hf(hf_dir), mesh=fpp.Mesh(cp=2), rules=llama.default_rules(tp=False))


def test_packed_documents_each_as_alone(hf_dir):
    """A row of packed documents (``segments``) gives each document's logits alone (the convolution
    and the state restart at each document); one long document is not (the test can fail)."""
    from functional_pp.parallel import sharding
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    named = sharding.named_tree(params, llama.init(cfg, torch.float64))
    lengths = [5, 2, 6]
    toks = torch.randint(0, 256, (2, sum(lengths)), generator=torch.Generator().manual_seed(6))
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1).contiguous()
    with torch.no_grad():
        packed = llama.forward(named, fpp.wrap(toks, "batch seq"), cfg, segments=fpp.wrap(seg, "batch seq")).value()
        whole = llama.forward(named, fpp.wrap(toks, "batch seq"), cfg).value()
        start = 0
        for n in lengths:
            alone = llama.forward(named, fpp.wrap(toks[:, start:start + n], "batch seq"), cfg).value()
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-10, atol=1e-10)
            start += n
    assert not torch.allclose(whole[:, 5:], packed[:, 5:])


def test_flops_count_the_mixers(hf_dir):
    from functional_pp.models import mamba1
    cfg = hf.config_from_hf(hf_dir)
    want = 3 * (cfg.layers * mamba1.flops_per_token(cfg.mamba1, cfg.hidden) + 2 * cfg.hidden * cfg.vocab)
    assert llama.flops_per_token(cfg, 12) == pytest.approx(want)


def test_refused_by_name(hf_dir):
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    batch = make_batch(cfg, batch=2, seq=8, seed=5)
    from functional_pp.models import sampling
    from functional_pp.parallel import sharding
    named = sharding.named_tree(params, llama.init(cfg, torch.float64))
    with pytest.raises(ValueError, match=r"sampling \(generate\) with Mamba \(v1\) layers is not supported yet"):
        sampling.generate(lambda p, t: llama.forward(p, t, cfg), named, batch["tokens"][:, :4], max_new_tokens=2)
    assert "Mamba (v1) mixers" in llama.uncached_layers(cfg) and "Mamba (v1)" in llama.serial_under_cp(cfg)
    with pytest.raises(Exception, match="hidden_act='gelu' is not supported"):
        hf.config_from_hf({**CONFIG, "model_type": "mamba", "hidden_act": "gelu"})
    import dataclasses
    with pytest.raises(Exception, match=r"mamba1_dt_norms=True.*choose another model_type"):
        hf.save_hf_llama(params, dataclasses.replace(cfg, mamba1_dt_norms=True), "/nonexistent")
    with pytest.raises(ValueError, match=r"layer_blocks has mamba1 layers but mamba1_inner=0"):
        dataclasses.replace(cfg, mamba1_inner=0)


def test_selective_scan_matches_the_recurrence():
    """The op alone, on random inputs, against the recurrence written out in plain torch."""
    from functional_pp.models import mamba1
    g = torch.Generator().manual_seed(3)
    B, S, I, N = 2, 7, 5, 3
    x, dt = torch.randn(B, S, I, generator=g, dtype=torch.float64), torch.randn(B, S, I, generator=g, dtype=torch.float64)
    b, c = torch.randn(B, S, N, generator=g, dtype=torch.float64), torch.randn(B, S, N, generator=g, dtype=torch.float64)
    a_log, d, bias = torch.randn(I, N, generator=g).double(), torch.randn(I, generator=g).double(), torch.randn(I).double()
    y = mamba1.selective_scan(fpp.wrap(x, "batch seq mamba_inner"), fpp.wrap(dt, "batch seq mamba_inner"),
                              fpp.wrap(b, "batch seq ssm_state"), fpp.wrap(c, "batch seq ssm_state"),
                              fpp.wrap(a_log, "mamba_inner ssm_state"), fpp.wrap(d, "mamba_inner"),
                              fpp.wrap(bias, "mamba_inner")).value()
    delta, a = torch.nn.functional.softplus(dt + bias), -a_log.exp()
    h, want = torch.zeros(B, I, N, dtype=torch.float64), []
    for t in range(S):
        h = (delta[:, t, :, None] * a).exp() * h + delta[:, t, :, None] * b[:, t, None, :] * x[:, t, :, None]
        want.append((h * c[:, t, None, :]).sum(-1) + d * x[:, t])
    torch.testing.assert_close(y, torch.stack(want, 1), rtol=1e-12, atol=1e-12)
    # the loop over named slices (operands laid out differently) gives the same states as the local loop
    decay = fpp.wrap(torch.rand(B, S, I, N, generator=g, dtype=torch.float64), "batch seq mamba_inner ssm_state")
    inputs = fpp.wrap(torch.randn(B, S, I, N, generator=g, dtype=torch.float64), "batch seq mamba_inner ssm_state")
    from functional_pp import ops
    fast = mamba1._states(decay, inputs).value()
    slow = mamba1._states(decay, ops.transpose(inputs, "seq", "batch", "mamba_inner", "ssm_state"))
    torch.testing.assert_close(ops.transpose(slow, "batch", "seq", "mamba_inner", "ssm_state").value(), fast)
    assert torch.equal(fast[:, 0], inputs.value()[:, 0]) and not torch.allclose(fast[:, 1], inputs.value()[:, 1])
    # from a start state (a block's under cp), both loops against the recurrence
    start = torch.randn(B, I, N, generator=g, dtype=torch.float64)
    h, want = start, []
    for t in range(S):
        h = decay.value()[:, t] * h + inputs.value()[:, t]
        want.append(h)
    begin = fpp.wrap(start, "batch mamba_inner ssm_state")
    torch.testing.assert_close(mamba1._states(decay, inputs, begin).value(), torch.stack(want, 1), rtol=1e-12, atol=0)
    slow = mamba1._states(decay, ops.transpose(inputs, "seq", "batch", "mamba_inner", "ssm_state"), begin)
    torch.testing.assert_close(ops.transpose(slow, "batch", "seq", "mamba_inner", "ssm_state").value(),
                               torch.stack(want, 1), rtol=1e-12, atol=0)


def test_axolotl_mamba_lm_head_model_needs_a_mamba_config(hf_dir, tmp_path):
    """Axolotl's ``model_type: MambaLMHeadModel`` (mamba_ssm's class) reads base_model's config.json as
    the mamba family; a config.json of another model_type is refused by name before any work; CP is accepted."""
    import json

    from functional_pp.config import ConfigError, TrainConfig
    from functional_pp.config.models import model_config
    base = dict(datasets=[{"path": "x.jsonl", "type": "completion"}], micro_batch_size=1,
                model_type="MambaLMHeadModel")
    assert model_config(TrainConfig.from_dict({**base, "base_model": str(hf_dir)}, name="t")).mamba1_inner == 64
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
                                                      "num_attention_heads": 4, "intermediate_size": 64,
                                                      "vocab_size": 256}))
    with pytest.raises(ConfigError, match=r"model_type: MambaLMHeadModel is a mamba model, but base_model .* "
                                          r"model_type 'llama'"):
        model_config(TrainConfig.from_dict({**base, "base_model": str(tmp_path)}, name="t"))
    with_cp = TrainConfig.from_dict({**base, "base_model": str(hf_dir), "context_parallel_size": 2}, name="t")
    assert model_config(with_cp).mamba1_inner == 64
    from functional_pp.app.sim_mode import needs_threads         # (the batched simulator names the layers)
    assert any("cp_size: 2 with a recurrence along the sequence (layers [0, 1] hold Mamba (v1) mixers" in r
               for r in needs_threads(with_cp))


def test_pipeline_equals_one_device(hf_dir):
    """1F1B over pp 2 (a Mamba layer on each stage, the tied embedding on both ends) equals one device's two steps."""
    one = assert_1f1b_equals_one_device(hf.config_from_hf(hf_dir), batch=4, grad_accum=2)
    assert one[0] != one[1]