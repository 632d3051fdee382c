"""Nemotron-H (``nemotron_h``) as a configuration of the one decoder (models/nemotron_h_hf.py,
models/mamba2.py): layers of one block each, Mamba2 / attention without a rotary / squared-ReLU MLP.
A tiny random model transformers builds from a config loads through the HF import (its files under
``backbone.``, in_proj and conv1d fused); logits, the fp64 loss and every gradient equal
transformers'; export writes ``NemotronHForCausalLM``, which loads with equal logits; LoRA on the
attention's q/k/v/o (Axolotl's targets) equals peft; FSDP x TP with sequence parallelism on
simulated devices, CP x TP (FSDP over cp) on simulated devices (plain and packed rows) and on real
gloo processes, and a 1F1B pipeline equal one device; packed documents each as alone; the key /
value cache refused by name (the mixture-of-experts layers: tests/models/test_nemotron_h_moe.py)."""
import pytest
import torch
from harness import (assert_1f1b_equals_one_device, assert_cp_equals_one_device, assert_export_round_trip,
                     assert_hf_layout_equals_one_device, assert_lora_step_equals_peft,
                     assert_processes_equal_one_device, fp64_beside_hf, hf_scan_in_fp64, import_logits_beside_hf,
                     make_batch, parallel, single_device)

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronHForCausalLM"):
    pytest.skip("transformers without Nemotron-H", allow_module_level=True)

# Mamba2 (8 heads in 2 groups, chunks of 4 of the 12-token sequences), attention, MLP, Mamba2
CONFIG = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
              intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=4,
              time_step_limit=(0.0, 2.0), pad_token_id=None, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**CONFIG))
    with torch.no_grad():                       # the scan's and the norms' parameters off their initial values
        for n, p in model.named_parameters():
            if n.endswith(("A_log", "D", "dt_bias", "conv1d.bias")) or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("nemotron_h")
    model.save_pretrained(out)
    return out


def test_config_and_files_read(hf_dir):
    cfg = hf.config_from_hf(hf_dir)
    assert cfg.layer_blocks == ("mamba2", "attention", "mlp", "mamba2")
    assert (cfg.mamba_heads, cfg.mamba_groups, cfg.ssm_state, cfg.mamba_chunk, cfg.mamba_dt_limit) == (8, 2, 8, 4,
                                                                                                      (0.0, 2.0))
    assert not any(cfg.rotates(i) for i in range(cfg.layers)) and cfg.mlp_act == "relu2" and not cfg.mlp_gated


def test_logits_equal_transformers(hf_dir):
    model = transformers.NemotronHForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    import_logits_beside_hf(model, hf_dir)


def test_fp64_loss_and_every_gradient_equal_transformers(hf_dir, tmp_path):
    from safetensors.torch import load_file
    with hf_scan_in_fp64():
        model, cfg, loss, grads, out, want = fp64_beside_hf(hf_dir, "NemotronHForCausalLM")
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    want.backward()
    hf.save_hf_llama(grads, cfg, tmp_path / "grads")
    ours = load_file(str(tmp_path / "grads" / "model.safetensors"))
    theirs = {n.replace("model.", "backbone.", 1): p.grad for n, p in model.named_parameters()}
    assert set(ours) == set(theirs)
    for name, g in ours.items():
        assert theirs[name].abs().max() > 0, name
        torch.testing.assert_close(g, theirs[name], rtol=1e-8, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")


def test_export_round_trip(hf_dir, tmp_path):
    assert_export_round_trip(hf_dir, tmp_path / "out", "nemotron_h", "NemotronHForCausalLM")


def test_lora_on_attention_equals_peft(hf_dir):
    model = transformers.NemotronHForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert_lora_step_equals_peft(model, hf_dir, ["q_proj", "k_proj", "v_proj", "o_proj"], layers=1)


def test_fsdp_tp_sp_equals_one_device(hf_dir):
    assert_hf_layout_equals_one_device(hf_dir, "fsdp_tp_sp")


def test_tp_over_the_groups_with_their_heads_equals_one_device(hf_dir):
    """``ssm_groups="tp"`` (whole groups per device: no all-reduce in the gated norm; the default
    rules shard each group's heads, which works for any n_groups)."""
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    batch = make_batch(cfg, batch=2, seq=12, seed=4)
    one = parallel(cfg, params, batch, fpp.Mesh(), fpp.Rules())[0]
    rules = fpp.Rules(batch=("dp_replicate", "dp_shard"), heads="tp", kv_heads="tp", mlp="tp", vocab="tp",
                      ssm_groups="tp", ssm_group_heads=None)
    two = parallel(cfg, params, batch, fpp.Mesh(tp=2), rules)[0]
    torch.testing.assert_close(two[0], one[0], rtol=1e-10, atol=1e-12)
    for (p, a), (_, b) in zip(tree.leaves_with_paths(two[1]), tree.leaves_with_paths(one[1])):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m, p=p: f"{p}: {m}")


def test_cp_tp_real_processes_equal_one_device(hf_dir):
    """CP 2 x TP 2 (the sequence load-balanced over cp, the Mamba2 state handed between the processes;
    FSDP over cp) on four gloo processes: two AdamW steps equal one device's."""
    assert_processes_equal_one_device(hf.config_from_hf(hf_dir), mesh=fpp.Mesh(cp=2, tp=2), rules=llama.default_rules())


def test_context_parallelism_equals_one_device(hf_dir):
    """The Mamba2 layers under CP 2 x TP 2, and with sequence parallelism (ops/sequence_chain.py: each device scans its blocks from the
    state of the block before, the balanced split's blocks in sequence order), plain and packed rows."""
    assert_cp_equals_one_device(hf_dir)
    assert_cp_equals_one_device(hf_dir, rules=llama.default_rules(sequence_parallel=True))     # (SP: res_seq over cp x tp)


def test_pipeline_equals_one_device(hf_dir):
    """1F1B over pp 2 (layers of different blocks on each stage) equals one device's two steps."""
    one = assert_1f1b_equals_one_device(hf.config_from_hf(hf_dir))
    assert one[0] != one[1]


def test_config_with_cp_is_accepted_and_the_batched_simulator_names_the_layers(hf_dir):
    from functional_pp.app.sim_mode import needs_threads
    from functional_pp.config import TrainConfig
    from functional_pp.config.models import model_config
    base = dict(base_model=str(hf_dir), datasets=[{"path": "x.jsonl", "type": "completion"}], micro_batch_size=1)
    cfg = TrainConfig.from_dict({**base, "context_parallel_size": 2}, name="t")
    assert model_config(cfg).mamba_heads == 8
    assert any("cp_size: 2 with a recurrence along the sequence (layers [0, 3] hold Mamba2 mixers" in r
               for r in needs_threads(cfg))
    assert needs_threads(TrainConfig.from_dict(base, name="t")) == []


def test_packed_documents_each_as_alone_and_under_fsdp_tp_sp(hf_dir):
    """A row of packed documents (``segments``) gives each document's logits alone (attention and
    the Mamba2 state kept inside each); its loss and gradients under FSDP x TP + SP equal one device's."""
    from functional_pp.parallel import sharding
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    named = sharding.named_tree(params, llama.init(cfg, torch.float64))
    lengths = [7, 2, 7]
    toks = torch.randint(0, 256, (2, sum(lengths)), generator=torch.Generator().manual_seed(6))
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1).contiguous()
    with torch.no_grad():
        packed = llama.forward(named, fpp.wrap(toks, "batch seq"), cfg, segments=fpp.wrap(seg, "batch seq")).value()
        start = 0
        for n in lengths:
            alone = llama.forward(named, fpp.wrap(toks[:, start:start + n], "batch seq"), cfg).value()
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-10, atol=1e-10)
            start += n
    batch = {**make_batch(cfg, batch=4, seq=16, seed=7), "segments": seg[:1].expand(4, -1).contiguous()}
    loss, grads = single_device(cfg, params, batch)
    p_loss, p_grads, _ = parallel(cfg, params, batch, fpp.Mesh(dp_shard=2, tp=2),
                                  llama.default_rules(sequence_parallel=True))[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m, path=path: f"{path}: {m}")


def test_flops_count_each_layers_blocks(hf_dir):
    """The hybrid's training FLOPs are its layers' blocks': attention + MLP layers count as Llama's,
    a Mamba2 layer as its mixer's (models/mamba2.py), an MLP layer as the MLP alone."""
    import dataclasses

    from functional_pp.models import mamba2
    cfg = hf.config_from_hf(hf_dir)                          # mamba2, attention, mlp, mamba2
    full = dataclasses.replace(cfg, layer_blocks=None, mamba_heads=0)
    as_blocks = dataclasses.replace(cfg, layer_blocks=("attention+mlp",) * cfg.layers)
    assert llama.flops_per_token(as_blocks, 12) == llama.flops_per_token(full, 12)
    head = 2 * cfg.hidden * cfg.vocab                       # (forward FLOPs per token below; training 3x)
    layer = (llama.flops_per_token(full, 12) / 3 - head) / cfg.layers      # attention + MLP
    mlp = 2 * 2 * cfg.hidden * cfg.mlp                       # (up and down: not gated)
    want = 3 * (2 * mamba2.flops_per_token(cfg.mamba, cfg.hidden) + (layer - mlp) + mlp + head)
    assert llama.flops_per_token(cfg, 12) == pytest.approx(want)


def test_refused_by_name(hf_dir):
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    batch = make_batch(cfg, batch=2, seq=8, seed=5)
    from functional_pp.models import sampling
    from functional_pp.parallel import sharding
    named = sharding.named_tree(params, llama.init(cfg, torch.float64))
    with pytest.raises(ValueError, match=r"sampling \(generate\) with Mamba2 layers is not supported yet"):
        sampling.generate(lambda p, t: llama.forward(p, t, cfg), named, batch["tokens"][:, :4], max_new_tokens=2)
    with pytest.raises(Exception, match=r"hybrid_override_pattern 'M\*X-' has characters \['X'\]"):
        hf.config_from_hf({**CONFIG, "model_type": "nemotron_h", "layers_block_type": None,
                           "hybrid_override_pattern": "M*X-"})
    with pytest.raises(Exception, match="residual_in_fp32=True is not supported"):
        hf.config_from_hf({**CONFIG, "model_type": "nemotron_h", "residual_in_fp32": True})
    with pytest.raises(ValueError, match=r"attn_in_multiplier=2.0: these multipliers act in layers of "
                                         r"mamba2\|attention\+mlp blocks"):
        llama.Config.tiny(attn_in_multiplier=2.0)
    with pytest.raises(ValueError, match="n_groups=3 must divide"):
        hf.config_from_hf({**CONFIG, "model_type": "nemotron_h", "n_groups": 3})
