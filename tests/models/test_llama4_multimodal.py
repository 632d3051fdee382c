"""Llama 4 as Axolotl trains it: the multimodal checkpoint (``Llama4ForConditionalGeneration``,
model_type ``llama4``) read as its ``llama4_text`` decoder (``text_config``; the tensors under
``language_model.``, the vision model and projector left aside) with logits, fp64 loss and every
gradient equal to transformers' whole model's, and exported as ``Llama4ForCausalLM`` (the way the
Gemma 3 / Mistral 3 wrappers are)."""
import dataclasses
import json

import pytest
import torch
from harness import bnb_nf4_serialized, fp64_beside_hf, linearized_llama4, our_logits, tokens

from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.core.layout import Rules

transformers = pytest.importorskip("transformers")

# chunks and a temperature floor shorter than the 12-token sequences, so that they act
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=3, attn_scale=0.5,
            no_rope_layer_interval=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
            max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 100.0})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=16, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)
EAGER = dict(attn_implementation="eager")


def build_wrapped(**text) -> "transformers.Llama4ForConditionalGeneration":
    """A tiny random multimodal Llama 4 (a one-layer vision model beside a dense and an MoE layer)."""
    torch.manual_seed(0)
    conf = transformers.Llama4Config(text_config=dict(TEXT, **text), vision_config=VISION, image_token_index=300,
                                     boi_token_index=301, eoi_token_index=302)       # (past the vocabulary)
    model = transformers.Llama4ForConditionalGeneration(conf).float().eval()
    with torch.no_grad():              # O(1) logits, routers far from uniform
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    model = build_wrapped()
    d = tmp_path_factory.mktemp("llama4_mm")
    model.save_pretrained(d, safe_serialization=True)
    model.config._attn_implementation = model.config.text_config._attn_implementation = "eager"
    return model, d


def test_text_decoder_logits_equal_transformers(wrapped):
    model, d = wrapped
    cfg, params = hf.load_hf_llama(d)
    assert (cfg.model_type, cfg.text_of, cfg.experts, cfg.moe_layers, cfg.attention_chunk) == (
        "llama4_text", "llama4", 4, (1,), 4)
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    assert want.abs().max() > 0.5
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)


def test_loss_and_gradients_equal_transformers(wrapped):
    """fp64: the loss and the gradient of every text-decoder parameter of the whole model."""
    model, cfg, loss, grads, out, want = fp64_beside_hf(wrapped[1], "Llama4ForConditionalGeneration", **EAGER)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    ours = dict(tree.leaves_with_paths(grads))
    theirs = {n.removeprefix("language_model."): p.grad for n, p in model.named_parameters()
              if n.startswith("language_model.")}
    assert len(theirs) == 24 and all(g is not None for g in theirs.values())
    for name, g in theirs.items():
        m = f"layers.{name.split('.')[2]}.mlp" if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):
            got = torch.cat([ours[f"{m}.gate"], ours[f"{m}.up"]], -1)
        elif name.endswith("experts.down_proj"):
            got = ours[f"{m}.down"]
        elif name.endswith("router.weight"):
            got = ours[f"{m}.router"].T
        else:
            path = hf.our_path(name.replace(".feed_forward.", ".mlp."))
            got = hf.KINDS[hf.hf_kind(path, "llama4_text")].to_hf(ours[path])
        torch.testing.assert_close(got, g, rtol=1e-4, atol=1e-6 * g.abs().max().item(), msg=lambda m: f"{name}: {m}")


def test_export_writes_the_text_decoder(wrapped, tmp_path):
    """Export writes ``Llama4ForCausalLM`` (the vision model is not trained here, as for the
    other wrappers), which transformers loads with the whole model's logits and we read back."""
    model, d = wrapped
    cfg, params = hf.load_hf_llama(d)
    params = tree.tree_map(lambda t: t + 0.01 * torch.randn_like(t), params)          # not the file's values
    out = hf.save_hf_llama(params, cfg, tmp_path / "text")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("llama4_text", ["Llama4ForCausalLM"])
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **EAGER)
    assert type(back).__name__ == "Llama4ForCausalLM"
    toks = tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=toks).logits, our_logits(params, cfg, toks), atol=1e-5, rtol=1e-5)
    cfg2, again = hf.load_hf_llama(out)
    assert (cfg2.model_type, cfg2.text_of) == ("llama4_text", None)
    for (p, a), (_, b) in zip(tree.leaves_with_paths(params), tree.leaves_with_paths(again)):
        assert torch.equal(a, b), p


# ------------------------------------------------------------------ Axolotl's linearized experts
def _save(sd: dict, config: dict, d):
    from safetensors.torch import save_file
    d.mkdir()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def linearized(wrapped, tmp_path_factory):
    from safetensors.torch import load_file
    _, d = wrapped
    sd = linearized_llama4(load_file(str(d / "model.safetensors")))
    return sd, _save(sd, json.loads((d / "config.json").read_text()), tmp_path_factory.mktemp("lin") / "m")


def test_linearized_experts_read_stacked_and_written_back(wrapped, linearized, tmp_path):
    """Read into our stacked experts (logits equal transformers' model of the stacked file);
    export writes each expert's linear back under its linearized name, bit for bit."""
    from safetensors.torch import load_file
    model, d = wrapped
    sd, lin = linearized
    assert any(".experts.gate_projs.3.weight" in k for k in sd) and not any("gate_up_proj" in k for k in sd)
    cfg, params = hf.load_hf_llama(lin)
    assert (cfg.experts_linearized, cfg.text_of) == (True, "llama4")
    _, want = hf.load_hf_llama(d)
    for (p, a), (_, b) in zip(tree.leaves_with_paths(params), tree.leaves_with_paths(want)):
        assert torch.equal(a, b), p
    out = hf.save_hf_llama(params, cfg, tmp_path / "out")
    back = load_file(str(out / "model.safetensors"))
    text = {k.removeprefix("language_model."): t for k, t in sd.items() if k.startswith("language_model.")}
    assert back.keys() == text.keys()
    for k, t in back.items():
        assert torch.equal(t, text[k]), k
    stacked = hf.save_hf_llama(params, dataclasses.replace(cfg, experts_linearized=False), tmp_path / "stacked")
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in load_file(str(stacked / "model.safetensors"))


@pytest.mark.parametrize("double_quant", [False, True])
def test_prequantized_nf4_checkpoint_reads_as_bitsandbytes_dequantizes(wrapped, linearized, double_quant, tmp_path):
    """Axolotl's ``...-Linearized-bnb-nf4-bf16`` checkpoints: every linear (each expert's too)
    serialized 4-bit by bitsandbytes; read by dequantizing, bit for bit bitsandbytes' own
    ``dequantize_4bit`` of each weight."""
    import bitsandbytes.functional as F
    sd, _ = linearized
    q = bnb_nf4_serialized(sd, double_quant)
    conf = json.loads((wrapped[1] / "config.json").read_text())
    conf["quantization_config"] = dict(quant_method="bitsandbytes", load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                       bnb_4bit_use_double_quant=double_quant)
    d = _save(q, conf, tmp_path / "q")
    cfg, params = hf.load_hf_llama(d)
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    want, native = {}, 0
    for k in sd:
        if f"{k}.quant_state.bitsandbytes__nf4" not in q:
            want[k] = q[k]
            continue
        s = F.QuantState.from_dict({c[len(k) + 1:]: v for c, v in q.items() if c.startswith(k + ".")}, "cpu")
        absmax = F.dequantize_blockwise(s.absmax, s.state2) + s.offset if s.nested else s.absmax
        # bitsandbytes' reference dequantization (its CUDA kernel's flat blocks); its native CPU kernel
        # equals it where each row holds whole blocks (it blocks row by row: the dense down_proj's 96)
        want[k] = _dequantize_4bit_compute(q[k].reshape(-1), absmax, s.code, s.blocksize, s.shape, s.dtype)
        if s.shape[-1] % s.blocksize == 0:
            assert torch.equal(F.dequantize_4bit(q[k], s), want[k]), k
            native += 1
    assert native == 20     # (not the down projections of fewer than 64 inputs: the shared and routed experts', the dense 96)
    deq = _save(want, json.loads((wrapped[1] / "config.json").read_text()), tmp_path / "deq")
    _, same = hf.load_hf_llama(deq)
    assert (want["language_model.model.layers.0.self_attn.q_proj.weight"].float()
            - sd["language_model.model.layers.0.self_attn.q_proj.weight"]).abs().max() > 1e-3    # (it acts)
    for (p, a), (_, b) in zip(tree.leaves_with_paths(params), tree.leaves_with_paths(same)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), p


def test_broken_quantized_or_linearized_files_are_refused(linearized, tmp_path):
    from functional_pp import checkpoint as ck
    sd, lin = linearized
    conf = json.loads((lin / "config.json").read_text())
    gone = {k: t for k, t in sd.items() if not k.endswith("experts.up_projs.2.weight")}
    with pytest.raises(ck.CheckpointCorruptError, match=r"linearized experts of .*layers.1.feed_forward.experts are not"):
        hf.load_hf_llama(_save(gone, conf, tmp_path / "gone"))
    q = bnb_nf4_serialized(sd, False)
    q.pop("language_model.model.layers.0.self_attn.q_proj.weight.absmax")
    with pytest.raises(ck.CheckpointCorruptError, match=r"q_proj.weight.quant_state.bitsandbytes__nf4 without"):
        hf.load_hf_llama(_save(q, conf, tmp_path / "q"))


# ------------------------------------------------------------------ Axolotl's configs: LoRA targets, QLoRA runs
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "shared_expert.gate_proj",
           "shared_expert.up_proj", "shared_expert.down_proj")


def test_axolotl_lora_targets_equal_peft(wrapped, tmp_path):
    """The targets of Axolotl's Llama 4 configs (attention, the shared expert's projections): our
    loss and every adapter gradient of one step equal peft's on transformers' Llama 4."""
    from harness import assert_lora_step_equals_peft
    cfg, params = hf.load_hf_llama(wrapped[1])
    text = hf.save_hf_llama(params, cfg, tmp_path / "text")
    model = transformers.Llama4ForCausalLM.from_pretrained(text, dtype=torch.float32, **EAGER)
    assert_lora_step_equals_peft(model, text, TARGETS, count=2 * (4 + 4 + 3))    # (the dense layer has no shared_expert)


def test_qlora_run_on_linearized_nf4_checkpoint_exports_linearized(tmp_path):
    """``llama4_linearized_experts: true`` with QLoRA on a pre-quantized linearized checkpoint, FSDP 2 x
    EP 2 on 4 simulated devices: the experts are quantized too (bitsandbytes reaches each expert's
    linear), and the merged export (learning rate 1e-12: the base itself) writes the linearized names
    with the checkpoint's values (within the NF4 re-quantization of its bf16 dequantized weights)."""
    from safetensors.torch import load_file

    from functional_pp import cli
    model = build_wrapped(hidden_size=256)           # (4 blocks of 64 along hidden: FSDP x EP splits it 4 ways)
    model.save_pretrained(tmp_path / "mm")
    q = bnb_nf4_serialized(linearized_llama4(load_file(str(tmp_path / "mm" / "model.safetensors"))), double_quant=True)
    base = _save(q, json.loads((tmp_path / "mm" / "config.json").read_text()), tmp_path / "base")
    config = tmp_path / "qlora.yaml"
    config.write_text(f"base_model: {base}\nmodel_type: Llama4ForConditionalGeneration\nllama4_linearized_experts: true\n"
                      f"adapter: qlora\nload_in_4bit: true\nlora_target_modules: [{', '.join(TARGETS)}]\n"
                      "lora_r: 4\nlora_alpha: 8\nexpert_parallel_size: 2\ndp_shard_size: 2\nsequence_len: 16\n"
                      "micro_batch_size: 1\ngradient_accumulation_steps: 1\nmax_steps: 1\nsave_steps: 1\n"
                      "learning_rate: 1.0e-12\nlr_scheduler: constant\nwarmup_steps: 0\n"
                      "data: {path: null, max_bytes: 4000}\nlogging: {log_every: 1, plot: false}\n")
    out = tmp_path / "run"
    assert cli.main(["train", str(config), "--simulate", "4", "--output", str(out)]) == 0
    index = json.loads((out / "checkpoints" / "step-000001" / "index.json").read_text())
    assert "params.layers.1.mlp.down.codes" in index["tensors"]           # (the experts quantized)
    assert cli.main(["export", str(out), str(tmp_path / "merged"), "--merge-adapter"]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    cfg, want = hf.load_hf_llama(base)         # (the bnb-dequantized base, stacked)
    again = hf.save_hf_llama(want, cfg, tmp_path / "want")
    want = load_file(str(again / "model.safetensors"))
    assert merged.keys() == want.keys() and "model.layers.1.feed_forward.experts.down_projs.3.weight" in merged
    for k, t in merged.items():
        torch.testing.assert_close(t.float(), want[k].float(), rtol=0, atol=2e-2 * want[k].float().abs().max().item(),
                                   msg=lambda m: f"{k}: {m}")


SHARD_RULES = Rules(experts="dp_shard", mlp="tp", heads="tp", kv_heads="tp", vocab="tp")


def _shards(path: str) -> dict:
    """This device's parameters read from the checkpoint at ``path`` under :data:`SHARD_RULES`, with
    their global regions."""
    import functional_pp as fpp
    from functional_pp.core.layout import block_slices
    from functional_pp.models import llama
    cfg = hf.config_from_hf(path)
    with fpp.use_rules(SHARD_RULES):
        local = hf.load_hf_params(path, cfg)
    mesh, rank = fpp.current_mesh(), fpp.current_rank()
    return {p: (x, block_slices(tuple(d.shape), SHARD_RULES.resolve(d.dims, tuple(d.shape), mesh, name=p), mesh, rank))
            for (p, x), (_, d) in zip(tree.leaves_with_paths(local), tree.leaves_with_paths(llama.init(cfg)))}


@pytest.mark.multiprocess
def test_real_gloo_processes_read_their_shards_of_linearized_nf4_experts(linearized, wrapped, tmp_path):
    """EP x TP on four gloo processes: each reads only its experts' rows and its columns of the
    linearized, NF4-serialized experts (and its heads of the attention), equal to the whole tensor's block."""
    import functools

    import functional_pp as fpp
    sd, _ = linearized
    d = _save(bnb_nf4_serialized(sd, True), json.loads((wrapped[1] / "config.json").read_text()), tmp_path / "q")
    _, whole = hf.load_hf_llama(d)
    flat, split = dict(tree.leaves_with_paths(whole)), set()
    for shards in fpp.launch(functools.partial(_shards, str(d)), fpp.Mesh(dp_shard=2, tp=2), processes=True,
                             timeout=300):
        for p, (x, region) in shards.items():
            assert torch.equal(x, flat[p][region]), p
            split.update([p] if x.shape != flat[p].shape else [])
    assert {"layers.1.mlp.gate", "layers.1.mlp.up", "layers.1.mlp.down", "layers.0.self_attn.q_proj"} <= split
