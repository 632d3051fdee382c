"""Llama 4 as Axolotl trains it: the multimodal checkpoint (``Llama4ForConditionalGeneration``,
model_type ``llama4``) read as its ``llama4_text`` decoder (``text_config``; the tensors under
``language_model.``, the vision model and projector left aside) with logits, fp64 loss and every
gradient equal to transformers' whole model's, and exported as ``Llama4ForCausalLM`` (the way the
Gemma 3 / Mistral 3 wrappers are)."""
import json

import pytest
import torch
from harness import fp64_beside_hf, our_logits, tokens

from functional_pp.checkpoint import hf
from functional_pp.core import tree

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


def build_wrapped() -> "transformers.Llama4ForConditionalGeneration":
    """A tiny random multimodal Llama 4 (a one-layer vision model beside a dense and an MoE layer)."""
    torch.manual_seed(0)
    conf = transformers.Llama4Config(text_config=TEXT, vision_config=VISION, image_token_index=300,
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
